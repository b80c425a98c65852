"""polykv-make-model: the generated GGUF loads in llama.cpp, its tokenizer round-trips text,
its chat template renders ChatML, greedy decoding is deterministic and varied, and the file
itself is byte-for-byte reproducible. Runs on the `test` preset (about a second in all)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as L
import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from polykv_engine.llama.runtime import init_backend
from polykv_modelgen import cli as mm
from polykv_modelgen import vocab as mv

ENGLISH = (
    "Last summer my grandmother decided to plant a small garden behind her house. She bought "
    "seeds for tomatoes, beans and several kinds of flowers, and every morning she walked out "
    "to water them before the sun got too hot. By the end of August the garden was full of "
    "color, and she gave away more food than she could ever eat herself."
)
CODE = '''def fib(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    out = [0, 1]
    while len(out) < n:
        out.append(out[-1] + out[-2])
    return out[:n]


if __name__ == "__main__":
    print(json.dumps({"values": fib(10)}, indent=2))
'''
ROUND_TRIP = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog. 1234567890 ~`@#$%^&*()",
    "unicode": "naïve café, Ünïcödé, Ελληνικά, русский, 日本語, 한국어, emoji 🚀👍🏽, e\u0301",
    "whitespace": "line one\nline two\r\n\n\ttabbed\t\t  double  spaces   \n\n\n  trailing  ",
    "code": CODE,
    "punctuation": "a . b , c ? d ! ' e ' it 's we 're -- ... <tag> </tag> {\"k\": [1, 2]}",
    "special_text": "<|im_start|> and <|endoftext|> typed as plain text",
    "empty_ish": " ",
}


@dataclass
class Loaded:
    path: Path
    model: Any
    vocab: Any

    def tokenize(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        data = text.encode()
        n_max = len(data) + 8
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        assert n >= 0, n
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        assert n >= 0, n
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> bytes:
        arr = (L.llama_token * max(1, len(tokens)))(*tokens)
        size = 16 * len(tokens) + 16
        buf = ctypes.create_string_buffer(size)
        n = L.llama_detokenize(self.vocab, arr, len(tokens), buf, size, False, False)
        assert n >= 0, n
        return buf.raw[:n]

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.raw[:n].decode()


def _generate(out: Path, *args: str) -> None:
    assert mm.main([*args, str(out)]) == 0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("make_model") / "test.gguf"
    _generate(path, "--preset", "test")
    return path


@pytest.fixture(scope="module")
def loaded(model_path: Path) -> Iterator[Loaded]:
    init_backend()  # the wheel's per-CPU ggml modules: nothing else may have loaded them yet
    model = L.llama_model_load_from_file(str(model_path).encode(), L.llama_model_default_params())
    assert model, "llama.cpp failed to load the generated model"
    try:
        yield Loaded(model_path, model, L.llama_model_get_vocab(model))
    finally:
        L.llama_model_free(model)


def test_loads_with_declared_shape_and_ids(loaded: Loaded) -> None:
    spec = mm.PRESETS["test"]
    v = loaded.vocab
    assert L.llama_vocab_n_tokens(v) == len(mv.build_vocab().tokens)
    assert L.llama_model_n_ctx_train(loaded.model) == spec.ctx == 8192
    assert L.llama_model_n_embd(loaded.model) == spec.embd
    assert L.llama_model_n_layer(loaded.model) == spec.layers
    assert loaded.meta("general.architecture") == "llama"
    assert loaded.meta("tokenizer.ggml.pre") == mv.PRE_TOKENIZER
    assert (L.llama_vocab_bos(v), L.llama_vocab_eos(v)) == (mv.BOS_ID, mv.EOS_ID)
    assert (L.llama_vocab_eot(v), L.llama_vocab_pad(v)) == (mv.IM_END_ID, mv.PAD_ID)
    assert L.llama_vocab_get_add_bos(v) and not L.llama_vocab_get_add_eos(v)
    for tid, text in mv.SPECIAL_TOKENS.items():
        assert L.llama_vocab_is_control(v, tid)
        assert loaded.piece(tid, special=True) == text.encode()
        assert loaded.piece(tid, special=False) == b""
    for tid in (mv.EOS_ID, mv.IM_END_ID):
        assert L.llama_vocab_is_eog(v, tid)
    assert not L.llama_vocab_is_eog(v, mv.IM_START_ID)
    # Byte tokens sit at id == byte value.
    assert loaded.tokenize("\n") == [10]
    assert loaded.tokenize("A") == [ord("A")]


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_tokenize_round_trips(loaded: Loaded, name: str) -> None:
    text = ROUND_TRIP[name]
    tokens = loaded.tokenize(text)
    assert tokens and all(0 <= t < L.llama_vocab_n_tokens(loaded.vocab) for t in tokens)
    # Pieces may split a multi-byte character, so join bytes before decoding.
    assert b"".join(loaded.piece(t) for t in tokens).decode() == text
    # llama_detokenize applies no space clean-up for this pre-tokenizer: exact too.
    assert loaded.detokenize(tokens).decode() == text
    # Special-token text is plain text unless parse_special is asked for.
    assert not set(tokens) & set(mv.SPECIAL_TOKENS)


def test_add_special_and_parse_special(loaded: Loaded) -> None:
    assert loaded.tokenize("hi", add_special=True)[0] == mv.BOS_ID
    tokens = loaded.tokenize("<|im_start|>user\nhi<|im_end|>\n", parse_special=True)
    assert tokens[0] == mv.IM_START_ID and mv.IM_END_ID in tokens
    assert (
        b"".join(loaded.piece(t, special=True) for t in tokens)
        == b"<|im_start|>user\nhi<|im_end|>\n"
    )


def test_merges_compress_common_text(loaded: Loaded) -> None:
    for word in (" the", " and", " that", " with", "The", " return", " def", " self", "    "):
        assert len(loaded.tokenize(word)) == 1, word
    english = len(loaded.tokenize(ENGLISH)) / len(ENGLISH)
    code = len(loaded.tokenize(CODE)) / len(CODE)
    print(f"tokens per char: english {english:.3f}, code {code:.3f}")
    assert english < 0.35
    assert code < 0.6
    # Every multi-letter English word of the paragraph costs fewer tokens than letters.
    for word in {w.strip(".,") for w in ENGLISH.split()}:
        if len(word) > 2:
            assert len(loaded.tokenize(" " + word)) < len(word), word


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
    {"role": "assistant", "content": "18 degrees."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _render(template: str, **variables: Any) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, **_: json.dumps(value)
    return env.from_string(template).render(**variables)


def test_chat_template_in_gguf_renders_chatml(loaded: Loaded) -> None:
    template = L.llama_model_chat_template(loaded.model, None)
    assert template is not None and template.decode() == mv.CHAT_TEMPLATE
    assert loaded.meta("tokenizer.chat_template") == mv.CHAT_TEMPLATE

    plain = _render(
        mv.CHAT_TEMPLATE,
        messages=[{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
    )
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

    full = _render(
        mv.CHAT_TEMPLATE, messages=CONVERSATION, tools=TOOLS, add_generation_prompt=False
    )
    assert full.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in full
    assert full.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n<tool_response>\n{"temp": 18}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n18 degrees.<|im_end|>\n"
    )
    # Dict arguments are serialised; a system message alone needs no tools block.
    calls = [{"role": "assistant", "content": "ok", "tool_calls": [{"name": "f", "arguments": {}}]}]
    assert _render(mv.CHAT_TEMPLATE, messages=calls) == (
        '<|im_start|>assistant\nok\n<tool_call>\n{"name": "f", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
    )
    assert _render(mv.CHAT_TEMPLATE, messages=CONVERSATION[:1]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    )


def test_llama_cpp_builtin_chatml_agrees(loaded: Loaded) -> None:
    # llama.cpp detects ChatML from the template; its C renderer must match the Jinja one.
    msgs = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]
    arr = (L.llama_chat_message * len(msgs))(
        *(L.llama_chat_message(r.encode(), c.encode()) for r, c in msgs)
    )
    buf = ctypes.create_string_buffer(4096)
    template = L.llama_model_chat_template(loaded.model, None)
    n = L.llama_chat_apply_template(template, arr, len(msgs), True, buf, len(buf))
    assert 0 < n < len(buf)
    expected = _render(
        mv.CHAT_TEMPLATE,
        messages=[{"role": r, "content": c} for r, c in msgs],
        add_generation_prompt=True,
    )
    assert buf.raw[:n].decode() == expected


def _greedy(loaded: Loaded, prompt: str, n_predict: int) -> list[int]:
    params = L.llama_context_default_params()
    params.n_ctx = 256
    params.n_batch = 256
    params.n_threads = params.n_threads_batch = 1
    ctx = L.llama_init_from_model(loaded.model, params)
    assert ctx
    try:
        tokens = loaded.tokenize(prompt, add_special=True)
        n_vocab = L.llama_vocab_n_tokens(loaded.vocab)
        out: list[int] = []
        feed = tokens
        for _ in range(n_predict):
            arr = (L.llama_token * len(feed))(*feed)
            assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(feed))) == 0
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            out.append(token)
            feed = [token]
        return out
    finally:
        L.llama_free(ctx)


def test_greedy_generation_is_deterministic_and_varied(loaded: Loaded) -> None:
    first = _greedy(loaded, "Once upon a time", 48)
    assert _greedy(loaded, "Once upon a time", 48) == first
    assert len(set(first)) >= 12, first  # not stuck on one token
    assert _greedy(loaded, "A different prompt", 48) != first
    # Control and non-text byte tokens never win: output is clean text that does not end early.
    assert not set(first) & set(mv.quiet_token_ids())
    b"".join(loaded.piece(t) for t in first).decode("ascii")


def test_file_is_byte_identical_per_arguments(model_path: Path, tmp_path: Path) -> None:
    # A fresh process with another string-hash seed: no set/dict-order leaks into the file.
    again = tmp_path / "again.gguf"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cmd = [sys.executable, "-m", "polykv_modelgen.cli", "--preset", "test", str(again)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=120)
    assert again.read_bytes() == model_path.read_bytes()
    reseeded = tmp_path / "seed1.gguf"
    _generate(reseeded, "--preset", "test", "--seed", "1")
    assert reseeded.read_bytes() != model_path.read_bytes()
    assert reseeded.stat().st_size == model_path.stat().st_size
    assert not list(tmp_path.glob(".*.tmp")), "temp file left behind"


def test_overrides_change_shape(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    args = ["--layers", "1", "--embd", "32", "--heads", "2", "--heads-kv", "1", "--ff", "64"]
    _generate(path, "--preset", "bench", *args, "--dtype", "f32", "--ctx", "1024")
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    assert model
    try:
        assert L.llama_model_n_layer(model) == 1
        assert L.llama_model_n_embd(model) == 32
        assert L.llama_model_n_head(model) == 2
        assert L.llama_model_n_head_kv(model) == 1
        assert L.llama_model_n_ctx_train(model) == 1024
    finally:
        L.llama_model_free(model)


@pytest.mark.parametrize(
    ("preset", "low_mb", "high_mb"), [("test", 0.5, 3.0), ("bench", 100.0, 200.0)]
)
def test_preset_sizes(preset: str, low_mb: float, high_mb: float) -> None:
    spec = mm.PRESETS[preset]
    mm.validate(spec)
    itemsize = 2 if spec.dtype == "f16" else 4
    shapes = mm.tensor_shapes(spec, len(mv.build_vocab().tokens))
    size = sum(int(np.prod(s)) * (itemsize if len(s) == 2 else 4) for s in shapes.values())
    assert low_mb * 1e6 < size < high_mb * 1e6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "huge"], "invalid choice: 'huge'"),
        (["--embd", "64", "--heads", "5"], "--heads 5 must divide --embd 64"),
        (["--heads", "4", "--heads-kv", "3"], "--heads-kv 3 must divide --heads 4"),
        (["--layers", "0"], "--layers must be >= 1"),
        (["--dtype", "q4"], "invalid choice: 'q4'"),
        (["--embd", "lots"], "invalid int value"),
    ],
)
def test_bad_arguments_exit_2_without_traceback(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "bad.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "polykv_modelgen.cli", *args, str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("preset", "arch", "recurrent", "hybrid", "window"),
    [
        ("test-swa", "gemma3", False, False, 32),
        ("test-mamba", "mamba", True, False, 0),
        ("test-jamba", "jamba", False, True, 0),
    ],
)
def test_other_architectures_load_and_decode(
    tmp_path: Path, preset: str, arch: str, recurrent: bool, hybrid: bool, window: int
) -> None:
    # The architectures pools must handle besides plain attention: llama.cpp recognizes
    # each as what it is, and each decodes greedy text that is varied and repeatable.
    path = tmp_path / f"{preset}.gguf"
    _generate(path, "--preset", preset)
    init_backend()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    assert model, f"llama.cpp failed to load the generated {arch} model"
    try:
        other = Loaded(path, model, L.llama_model_get_vocab(model))
        assert other.meta("general.architecture") == arch
        assert bool(L.llama_model_is_recurrent(model)) == recurrent
        assert bool(L.llama_model_is_hybrid(model)) == hybrid
        assert L.llama_model_n_swa(model) == window
        first = _greedy(other, "Once upon a time", 40)
        assert _greedy(other, "Once upon a time", 40) == first
        assert len(set(first)) >= 12, first
        assert not set(first) & set(mv.quiet_token_ids())
    finally:
        L.llama_model_free(model)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "test-swa", "--window", "0"], "--window must be in [1, --ctx 8192)"),
        (["--preset", "test-swa", "--swa-pattern", "1"], "--swa-pattern must be >= 2"),
        (["--preset", "test-jamba", "--attn-every", "9"], "--attn-every must be in [2, --layers"),
        (["--preset", "test-mamba", "--ssm-conv", "1"], "--ssm-conv >= 2"),
        (["--arch", "rwkv"], "invalid choice: 'rwkv'"),
    ],
)
def test_bad_architecture_arguments_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "bad.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "polykv_modelgen.cli", *args, str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not out.exists()
