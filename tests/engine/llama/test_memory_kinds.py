"""The llama.cpp mechanisms pools stand on, for each kind of model memory, checked on the
runtime itself before the engine relies on them.

Sliding window (llama.cpp's iSWA cache): ``find_slot`` hands out a cell that only one
sequence holds once it is outside that sequence's window, so a pool's own cells, with no
session attached, are overwritten by the next sessions. A cell that two sequences hold is
never handed out that way: a pool whose tokens are decoded into the pool's sequence and a
guard sequence together (one batch token, two sequence ids) keeps every cell, and a session
that shares them later computes what a full prefill computes.

Recurrent and hybrid memory: a sequence holds one state, exact only after its last token.
``seq_cp`` gives the destination that state (and, in a hybrid, the attention cells), so a
session attached at exactly the pool's length continues as a full prefill would; a pool's
state cannot be cut back to an earlier position (``seq_rm`` refuses), so nothing shorter can
be attached or branched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from polykv_engine.llama.runtime import Batch, LlamaRuntime, RuntimeConfig

POOL, GUARD, SESSION, OTHER = 2, 3, 0, 1
N_SEQ = 4


def open_runtime(model: Path, swa_full: bool = True) -> LlamaRuntime:
    # f32 KV and no flash attention: a shared prefix and a fresh prefill give the same
    # logits to float rounding, so a recycled cell shows as a real difference.
    cfg = RuntimeConfig(
        model_path=model,
        n_ctx=1024,
        n_batch=64,
        n_ubatch=16,  # a build chunk spans several micro-batches
        n_seq_max=N_SEQ,
        n_threads=1,
        flash_attn="off",
        cache_type_k="f32",
        cache_type_v="f32",
        swa_full=swa_full,
    )
    return LlamaRuntime(cfg)


def words(rt: LlamaRuntime, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    text = " ".join(rng.choice(["river", "light", "garden", "window", "train", "quiet"], 4 * n))
    tokens = rt.tokenize(text, add_special=False, parse_special=False)
    assert len(tokens) >= n
    return tokens[:n]


def prefill(
    rt: LlamaRuntime, batch: Batch, tokens: list[int], pos0: int, seq: int, also: int | None
) -> None:
    """Decode ``tokens`` into ``seq`` (and ``also``) in batch-sized chunks, no logits."""
    for i in range(0, len(tokens), batch.capacity):
        batch.clear()
        batch.add_span(tokens[i : i + batch.capacity], pos0 + i, seq, False, also)
        assert rt.decode(batch) == 0


def continuation_logits(
    rt: LlamaRuntime, batch: Batch, suffix: list[int], pos0: int, seq: int
) -> np.ndarray:
    batch.clear()
    batch.add_span(suffix, pos0, seq, True)
    assert rt.decode(batch) == 0
    return rt.logits(batch.n - 1).copy()


def fresh_logits(model: Path, tokens: list[int]) -> np.ndarray:
    rt = open_runtime(model)
    batch = rt.new_batch()
    try:
        prefill(rt, batch, tokens[:-1], 0, SESSION, None)
        return continuation_logits(rt, batch, tokens[-1:], len(tokens) - 1, SESSION)
    finally:
        rt.close()


def decode_one_by_one(rt: LlamaRuntime, batch: Batch, seq: int, n: int, seed: int) -> None:
    """``n`` tokens decoded one at a time. Each step takes the first cell from the cache's
    head on that is empty or out of its holder's window."""
    for pos, tok in enumerate(words(rt, n, seed)):
        batch.clear()
        batch.add(tok, pos, seq, True)
        assert rt.decode(batch) == 0


def cells_below(rt: LlamaRuntime, batch: Batch, build: Callable[[], None]) -> None:
    """Run ``build`` above another session's cells, then let that session go: the head
    moves back below the built cells, so the next sessions sweep over them."""
    decode_one_by_one(rt, batch, SESSION, 100, seed=9)
    build()
    rt.seq_rm(SESSION)


def churn(rt: LlamaRuntime, batch: Batch, seq: int, n: int, seed: int) -> None:
    """Another session comes and goes."""
    decode_one_by_one(rt, batch, seq, n, seed)
    rt.seq_rm(seq)


@pytest.fixture
def swa(swa_model: Path) -> Iterator[tuple[LlamaRuntime, Batch]]:
    rt = open_runtime(swa_model)
    assert rt.info.n_swa == 32
    yield rt, rt.new_batch()
    rt.close()


@pytest.mark.parametrize("guarded", [False, True])
def test_a_guard_sequence_keeps_a_pool_whole_past_the_window(
    swa: tuple[LlamaRuntime, Batch], swa_model: Path, guarded: bool
) -> None:
    rt, batch = swa
    prefix = words(rt, 160, seed=1)  # five windows long
    # Sessions come and go past the window, sweeping over the pool's cells again and again.
    cells_below(rt, batch, lambda: prefill(rt, batch, prefix, 0, POOL, GUARD if guarded else None))
    for k in range(6):
        churn(rt, batch, OTHER, 150 + 20 * k, seed=10 + k)
    if not guarded:
        # The pool's oldest cells went to the other session: its prefix has holes.
        assert rt.seq_pos_min(POOL) > 0
        return
    assert rt.seq_pos_min(POOL) == 0 and rt.seq_pos_max(POOL) == len(prefix) - 1
    suffix = words(rt, 5, seed=2)
    rt.seq_cp(POOL, SESSION, 0, len(prefix))
    shared = continuation_logits(rt, batch, suffix, len(prefix), SESSION)
    fresh = fresh_logits(swa_model, prefix + suffix)
    assert np.abs(shared - fresh).max() < 1e-3
    assert int(shared.argmax()) == int(fresh.argmax())


def test_what_is_left_of_a_recycled_sequence_is_one_run_from_pos_min(
    swa: tuple[LlamaRuntime, Batch], swa_model: Path
) -> None:
    # A session's own cells, out of its window, are handed out as others come and go; each
    # one takes every position below it along (llama.cpp keeps [pos_min, pos_max] whole), so
    # pos_min says exactly what is left. What is left still serves a second session whose
    # window needs no more (automatic sharing), and once two sequences hold those cells they
    # are not handed out again.
    rt, batch = swa
    prefix = words(rt, 160, seed=3)
    cells_below(rt, batch, lambda: prefill(rt, batch, prefix, 0, OTHER, None))
    for k in range(6):
        churn(rt, batch, GUARD, 150 + 20 * k, seed=20 + k)
    left = rt.seq_pos_min(OTHER)
    assert 0 < left <= len(prefix) - 32 + 1, left  # recycled, the last window still there
    rt.seq_cp(OTHER, SESSION, 0, len(prefix))
    assert rt.seq_pos_min(SESSION) == left
    for k in range(4):
        churn(rt, batch, GUARD, 150 + 20 * k, seed=30 + k)
    assert rt.seq_pos_min(SESSION) == rt.seq_pos_min(OTHER) == left
    suffix = words(rt, 5, seed=4)
    shared = continuation_logits(rt, batch, suffix, len(prefix), SESSION)
    fresh = fresh_logits(swa_model, prefix + suffix)
    assert np.abs(shared - fresh).max() < 1e-3
    assert int(shared.argmax()) == int(fresh.argmax())


@pytest.mark.parametrize("kind", ["mamba", "jamba"])
def test_recurrent_state_is_shared_exactly_at_the_prefix_length(
    kind: str, mamba_model: Path, jamba_model: Path
) -> None:
    model = mamba_model if kind == "mamba" else jamba_model
    rt = open_runtime(model)
    batch = rt.new_batch()
    try:
        assert rt.info.is_recurrent == (kind == "mamba")
        assert rt.info.is_hybrid == (kind == "jamba")
        prefix = words(rt, 90, seed=5)
        prefill(rt, batch, prefix, 0, POOL, None)
        # Two sessions attach at exactly L and go their own ways: each computes what a
        # full prefill computes, and the first one's decode leaves the pool's state alone.
        suffixes = [words(rt, 4, seed=6), words(rt, 7, seed=7)]
        for seq, suffix in zip((SESSION, OTHER), suffixes, strict=True):
            rt.seq_cp(POOL, seq, 0, len(prefix))
            shared = continuation_logits(rt, batch, suffix, len(prefix), seq)
            fresh = fresh_logits(model, prefix + suffix)
            assert np.abs(shared - fresh).max() < 1e-3
        # The state exists only after the last token: a pool cannot be cut back to an
        # earlier position (what attaching or branching below L would need).
        assert not rt.try_seq_rm(POOL, len(prefix) - 10, -1)
        assert rt.seq_pos_max(POOL) == len(prefix) - 1
        # Cutting nothing (at or past the end) and removing it whole are fine.
        assert rt.try_seq_rm(POOL, len(prefix), -1)
        assert rt.try_seq_rm(POOL, 0, -1)
        assert rt.seq_pos_max(POOL) == -1
    finally:
        rt.close()


@pytest.mark.parametrize(
    ("kind", "attends", "stateful"),
    [("test", True, False), ("swa", True, False), ("mamba", False, True), ("jamba", True, True)],
)
def test_memory_per_token_and_per_sequence_is_measured(
    kind: str,
    attends: bool,
    stateful: bool,
    test_model: Path,
    swa_model: Path,
    mamba_model: Path,
    jamba_model: Path,
) -> None:
    model = {"test": test_model, "swa": swa_model, "mamba": mamba_model, "jamba": jamba_model}
    rt = open_runtime(model[kind])
    try:
        # 2 attention layers of 2 KV heads x 16 dims, K and V in f32.
        assert rt.kv_bytes_per_token == (2 * 2 * 16 * 2 * 4 if attends else 0)
        # Mamba: per layer, a (conv - 1) x inner convolution state and an inner x state
        # recurrent state, f32, 2 Mamba layers (plus llama.cpp's few header bytes).
        per_layer = ((4 - 1) * 128 + 128 * 16) * 4
        if stateful:
            assert 2 * per_layer <= rt.state_bytes < 2 * per_layer + 256
        else:
            assert rt.state_bytes == 0
        assert rt.seq_pos_max(0) == -1  # the measurement left nothing behind
    finally:
        rt.close()
