"""Chat templates: --chat-template-file, else the model file's own, else its family's turn
format, else ChatML."""

from __future__ import annotations

from pathlib import Path

import pytest

from polykv_engine.chat.template import CHATML_TEMPLATE, ChatRenderer, fallback_template
from polykv_engine.cli import MAX_CHAT_TEMPLATE_BYTES, config_from_args

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello. "},
    {"role": "tool", "content": "42"},
]


def test_a_template_less_gemma_file_gets_gemma_turns() -> None:
    r = ChatRenderer(None, "<bos>", "<eos>", "gemma3")
    assert r.render(CONVERSATION) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\n42<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    # System text goes into the first user turn only; no generation prompt when not asked.
    once = r.render(CONVERSATION[:2], add_generation_prompt=False)
    assert once == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
    assert fallback_template("gemma2") == fallback_template("gemma3")
    # A system message with no user turn after it still reaches the model.
    late = [*CONVERSATION[1:3], {"role": "system", "content": "Answer in French."}]
    assert r.render(late) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nAnswer in French.<end_of_turn>\n<start_of_turn>model\n"
    )


def test_an_unknown_family_falls_back_to_chatml() -> None:
    assert fallback_template("llama") == CHATML_TEMPLATE
    r = ChatRenderer(None, "<s>", "</s>", "")
    assert r.render(CONVERSATION[:2]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_files_own_template_wins_over_its_family() -> None:
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    r = ChatRenderer(own, "<bos>", "<eos>", "gemma3")
    assert r.source == own
    assert r.render(CONVERSATION[1:2]) == "[user] Hi\n"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"  # the CLI only checks the file exists before it boots
    path.write_bytes(b"GGUF")
    return path


def test_a_template_file_replaces_the_models(model: Path, tmp_path: Path) -> None:
    own = tmp_path / "turns.jinja"
    own.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    _, settings, _ = config_from_args(["-m", str(model), "--chat-template-file", str(own)])
    assert settings.chat_template == own.read_text()
    _, settings, _ = config_from_args(["-m", str(model)])
    assert settings.chat_template is None


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "No such file"),
        ("{% for m in messages %}", "does not compile"),
        (b"\xff\xfe{{ x }}", "codec can't decode"),
        ("x" * (MAX_CHAT_TEMPLATE_BYTES + 1), f"over {MAX_CHAT_TEMPLATE_BYTES} bytes"),
    ],
)
def test_a_bad_template_file_is_refused_at_start(
    model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str | bytes | None,
    needle: str,
) -> None:
    path = tmp_path / "bad.jinja"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        config_from_args(["-m", str(model), "--chat-template-file", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--chat-template-file" in err and needle in err, err
