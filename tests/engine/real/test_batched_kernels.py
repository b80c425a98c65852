"""Our build's Q4_1 and Q5_1 kernels (scripts/patches/ggml-cpu-q4_1-cols.patch and
ggml-cpu-q5_1-cols.patch) compute what ggml's own kernels compute, bit for bit, on SmolLM2 as
published (Q4_1) and quantized here to Q5_1.

With flash attention on, llama.cpp's CPU logits do not depend on how tokens are batched: each
weight product is one dot product per (weight row, token), however many tokens share the step
(checked on the unpatched build too), and a row's attention depends only on the kernel it takes:
a row alone (a decoding session's token) the per-query kernel, one sequence's consecutive rows
the tiled one (the fa_runs kernel path, test_flash_attn_runs.py), whatever else shares the tile.
The patch sends a step of several tokens through a kernel that unpacks each weight block once
for up to 8 tokens, and a step of one token through one that reads the token's block once for 4
weight rows; ggml's kernel is left for the remainders. Each keeps the single kernel's arithmetic
per pair, so a batch's logits must equal, bit for bit, those of the same tokens decoded in
smaller steps: a column mixed up, a row skipped or a scale applied to the wrong token would
change them. The counts cover full groups and remainders (11 sessions: 8 + 3; a 37-token prompt:
4 x 8 + 5, against the same prompt 5 tokens a step: 7 x 5 + 2, never a row alone, so its
attention stays on one kernel)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from polykv_engine.llama.runtime import Batch, LlamaRuntime, RuntimeConfig
from tests.conftest import real_model_path

pytestmark = pytest.mark.real_model

# model -> the weight type its patched kernels take
MODELS = {"smollm2-135m-instruct-q4_1": "Q4_1", "smollm2-135m-instruct-q5_1": "Q5_1"}
SESSIONS = 11
PROMPT_LENS = [5, 9, 3, 12, 7, 4, 10, 6, 8, 2, 11]
STEPS = 4


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model_path(model: str) -> Path:
    return real_model_path(model)


@pytest.fixture
def runtime(model_path: Path) -> Iterator[LlamaRuntime]:
    rt = LlamaRuntime(
        RuntimeConfig(model_path, n_ctx=2048, n_batch=512, n_seq_max=SESSIONS, flash_attn="on")
    )
    try:
        yield rt
    finally:
        rt.close()


def decode(rt: LlamaRuntime, batch: Batch) -> None:
    assert rt.decode(batch) == 0


def sessions_run(rt: LlamaRuntime, together: bool) -> np.ndarray:
    """Prompts one session at a time, then STEPS decode steps of every session: in one batch
    (together) or one token per llama_decode. Returns the decode steps' logits."""
    batch = rt.new_batch()
    try:
        for s, n in enumerate(PROMPT_LENS):
            batch.clear()
            batch.add_span([50 + 3 * s + 7 * p for p in range(n)], 0, s, logits_last=True)
            decode(rt, batch)
        out = []
        for step in range(STEPS):
            tokens = [100 + 13 * s + 17 * step for s in range(SESSIONS)]
            rows = []
            if together:
                batch.clear()
                for s, tok in enumerate(tokens):
                    batch.add(tok, PROMPT_LENS[s] + step, s, True)
                decode(rt, batch)
                rows = [rt.logits(s).copy() for s in range(SESSIONS)]
            else:
                for s, tok in enumerate(tokens):
                    batch.clear()
                    batch.add(tok, PROMPT_LENS[s] + step, s, True)
                    decode(rt, batch)
                    rows.append(rt.logits(0).copy())
            out.append(np.stack(rows))
        return np.stack(out)
    finally:
        batch.free()


def prompt_run(rt: LlamaRuntime, chunk: int) -> np.ndarray:
    """One 37-token prompt fed `chunk` tokens per llama_decode, every position's logits."""
    tokens = [50 + 7 * p for p in range(37)]
    batch = rt.new_batch()
    out = []
    try:
        for start in range(0, len(tokens), chunk):
            batch.clear()
            part = tokens[start : start + chunk]
            for k, tok in enumerate(part):
                batch.add(tok, start + k, 0, True)
            decode(rt, batch)
            out += [rt.logits(i).copy() for i in range(len(part))]
        return np.stack(out)
    finally:
        batch.free()


def test_the_model_has_the_kernels_weight_type(runtime: LlamaRuntime, model: str) -> None:
    # Otherwise the tests below would not reach the patched kernel.
    assert MODELS[model] in runtime.info.description, runtime.info.description


def test_a_decode_step_of_eleven_sessions_equals_eleven_one_token_steps(
    runtime: LlamaRuntime,
) -> None:
    batched = sessions_run(runtime, together=True)
    runtime.clear_memory()
    single = sessions_run(runtime, together=False)
    assert np.isfinite(batched).all()
    assert np.array_equal(batched, single), float(np.abs(batched - single).max())
    # The sessions differ, so a kernel that wrote one session's result for all would fail.
    assert not np.array_equal(batched[:, 0], batched[:, 1])


def test_a_prompt_in_one_batch_equals_the_prompt_in_chunks(runtime: LlamaRuntime) -> None:
    whole = prompt_run(runtime, 37)
    runtime.clear_memory()
    chunked = prompt_run(runtime, 5)
    assert np.array_equal(whole, chunked), float(np.abs(whole - chunked).max())
