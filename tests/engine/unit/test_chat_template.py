"""Chat templates: the model file's own, else its family's turn format, else ChatML."""

from __future__ import annotations

from polykv_engine.chat.template import CHATML_TEMPLATE, ChatRenderer, fallback_template

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
