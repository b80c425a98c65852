"""Attention under 64 query rows (scripts/patches/ggml-cpu-tiled-fa-runs.patch): decoding
sessions and a paced prompt chunk, against numpy and against ggml's own tiled kernel.

Below GGML_FA_TILE_Q (64) query rows ggml runs its per-query kernel, which visits every
(row, head, cell) alone. Decoding sessions are a row each, and a prompt paced beside them
arrives in chunks of 8-60 tokens, so at 8k tokens of context both spent most of their step
there. The patch groups consecutive rows that see the same cells but one or two (one
sequence's consecutive prompt tokens; a sliding window drops its oldest cell as it adds one)
into runs, a row alone being a run of one, and every run takes ggml's tiled kernel, computing
only the run's rows, with the query heads that read one KV head in one tile (here 2 of the 4
heads per KV head: K and V converted once for both).

The batch here is a paced step in a unified cache: four decoding sessions over a shared prefix
with their cells interleaved after it, a newcomer's 20-token prompt chunk (it shares the prefix
and has its own block of cells), and a 12-row chunk of a sliding-window sequence. Checks:
  * every output against float64 softmax attention over the row's live cells: exactly (Q = 0,
    small-integer V: float32 sums of integers are exact) and within float32 rounding (random
    inputs);
  * the chunk's rows are bit-identical to the same rows in a batch of 64 rows or more, where
    ggml takes its tiled kernel for every row (upstream's choice), to the chunk alone (with
    no decoders beside it) and to each row alone, and every row differs from the per-query
    kernel's result (computed with the path off: evidence that the tiled kernel ran). With a
    mask, the tiled kernel packs into a tile only cells that some row of the tile sees (the
    decoders' cells interleave with a paced prompt's), so which cells share a tile depends on
    the tile's rows, never a row's arithmetic. Both paths attend span by span (1,024 cells
    each, so that a few rows can split a long cache across the threads) and fold the spans
    in one order, whatever the number of threads;
  * the decoding sessions' rows are bit-identical to a batch of decoding rows alone and to
    each session alone (one row, where upstream splits the cells by thread): what else is in
    a step does not change a session's arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.real.ggml_graphs import (
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    Graph,
    ggml,
    paths_process,
    require_avx2,
)

HEAD_DIM = 64
N_HEAD, N_HEAD_KV = 4, 2
SCALE = HEAD_DIM**-0.5
N_KV = 2115  # a ragged last KV tile (2115 = 33 x 64 + 3), three spans of 1024 cells
SPAN = 1024  # POLYKV_FA_SPAN: the kernel folds the cells span by span
PREFIX = 700  # cells 0..699: the pool's prefix, shared by the decoders and the newcomer
DECODERS = 4  # their cells interleave one in four from PREFIX to 999
NEWCOMER = range(1000, 1100)  # the newcomer's prompt cells, in order
CHUNK = range(1014, 1034)  # the chunk's rows (20): the first ten see nothing of the 2nd span
SWA_CELLS = range(1950, N_KV)  # a sliding-window sequence's cells
SWA_WINDOW = 64
SWA_ROWS = range(2102, 2114)  # its chunk: each row sees the last SWA_WINDOW cells up to its own
FA_TILE_Q = 64
EPS32 = 2.0**-23
U32 = 2.0**-24  # unit roundoff of float32


@pytest.fixture(scope="module", autouse=True)
def avx2() -> None:
    require_avx2()


def decoder_rows() -> np.ndarray:
    live = np.zeros((DECODERS, N_KV), dtype=bool)
    live[:, :PREFIX] = True
    owner = (np.arange(PREFIX, NEWCOMER.start) - PREFIX) % DECODERS
    for s in range(DECODERS):
        live[s, PREFIX : NEWCOMER.start] = owner == s
    return live


def chunk_rows() -> np.ndarray:
    live = np.zeros((len(CHUNK), N_KV), dtype=bool)
    for j, pos in enumerate(CHUNK):
        live[j, :PREFIX] = True
        live[j, NEWCOMER.start : pos + 1] = True  # causal: its prompt up to itself
    return live


def swa_rows() -> np.ndarray:
    live = np.zeros((len(SWA_ROWS), N_KV), dtype=bool)
    for j, pos in enumerate(SWA_ROWS):
        live[j, max(SWA_CELLS.start, pos - SWA_WINDOW + 1) : pos + 1] = True
    return live


def step_rows() -> np.ndarray:
    """A paced step: the decoders' tokens, then the two chunks (36 rows, under 64)."""
    return np.vstack([decoder_rows(), chunk_rows(), swa_rows()])


CHUNK_ROWS = list(range(DECODERS, DECODERS + len(CHUNK)))
SWA_RUN_ROWS = list(range(DECODERS + len(CHUNK), DECODERS + len(CHUNK) + len(SWA_ROWS)))
RUN_ROWS = CHUNK_ROWS + SWA_RUN_ROWS


def inputs(
    rng: np.random.Generator, rows: int, exact: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = rng.standard_normal((N_HEAD_KV, N_KV, HEAD_DIM)).astype(np.float16)
    if exact:
        # Q = 0: every live cell weighs exactly 1; V in -2..2: float32 sums stay exact.
        q = np.zeros((rows, N_HEAD, HEAD_DIM), dtype=np.float32)
        v = rng.integers(-2, 3, (N_HEAD_KV, N_KV, HEAD_DIM)).astype(np.float16)
    else:
        q = (2 * rng.standard_normal((rows, N_HEAD, HEAD_DIM))).astype(np.float32)
        v = rng.standard_normal((N_HEAD_KV, N_KV, HEAD_DIM)).astype(np.float16)
    return q, k, v


def gqa(h: int) -> int:
    return h // (N_HEAD // N_HEAD_KV)


def reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, live: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """float64 softmax attention over each row's live cells, and the float32 rounding bound
    of the tiled kernel (float32 Q and K, float32 accumulation): the scores' dot products,
    the exponentials and rescalings, the running sum of weighted V (a unit roundoff of its
    largest partial per cell) and the last division."""
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    out = np.zeros(q.shape)
    tol = np.zeros(q.shape)
    for i in range(q.shape[0]):
        cells = np.flatnonzero(live[i])
        for h in range(q.shape[1]):
            kh, vh = k64[gqa(h), cells], v64[gqa(h), cells]
            s = SCALE * (kh @ q[i, h].astype(np.float64))
            p = np.exp(s - s.max())
            denom = p.sum()
            out[i, h] = p @ vh / denom
            partial = np.abs(np.cumsum(p[:, None] * vh, axis=0)).max(axis=0)
            score_err = SCALE * HEAD_DIM * EPS32 * (np.abs(kh) @ np.abs(q[i, h])).max()
            weight_err = 2 * score_err + 8 * EPS32
            tol[i, h] = (
                2 * U32 * cells.size * partial / denom
                + 2 * weight_err * np.abs(vh - out[i, h]).max(axis=0)
                + (cells.size + 4) * EPS32 * np.abs(out[i, h])
            )
    return out, tol


def ggml_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, live: np.ndarray, n_threads: int
) -> np.ndarray:
    """ggml_flash_attn_ext: q [rows, heads, d] F32, k and v [kv heads, cells, d] F16, the mask
    of live (0 / -inf, F16); float32 [rows, heads, d]."""
    rows = q.shape[0]
    mask = np.where(live, 0.0, -np.inf).astype(np.float16)
    with Graph(2 * q.nbytes + k.nbytes + v.nbytes + mask.nbytes) as graph:
        qt = graph.tensor(GGML_TYPE_F32, [HEAD_DIM, rows, N_HEAD], q.transpose(1, 0, 2))
        kt = graph.tensor(GGML_TYPE_F16, [HEAD_DIM, N_KV, N_HEAD_KV], k)
        vt = graph.tensor(GGML_TYPE_F16, [HEAD_DIM, N_KV, N_HEAD_KV], v)
        mt = graph.tensor(GGML_TYPE_F16, [N_KV, rows], mask)
        out = int(graph.g.base.ggml_flash_attn_ext(graph.ctx, qt, kt, vt, mt, SCALE, 0.0, 0.0))
        return graph.compute(out, n_threads).reshape(rows, N_HEAD, HEAD_DIM)


def check(got: np.ndarray, want: np.ndarray, tol: np.ndarray, what: str) -> None:
    assert np.isfinite(got).all(), what
    bad = np.abs(got.astype(np.float64) - want) > tol
    if bad.any():
        i, h, d = np.argwhere(bad)[0]
        pytest.fail(
            f"{what}: row {i}, head {h}, dim {d}: ggml {got[i, h, d]!r}, reference "
            f"{want[i, h, d]!r}, tolerance {tol[i, h, d]!r} ({int(bad.sum())} outputs off)"
        )


def test_the_path_is_built_and_chosen() -> None:
    info = ggml().backend
    assert "ggml-cpu-tiled-fa-runs" in info.patches
    assert "fa_runs" in info.kernel_paths, (
        f"fa_runs is not among the chosen paths ({info.kernel_paths!r})"
    )


def test_the_step_is_shaped_like_a_paced_step() -> None:
    live = step_rows()
    assert live.shape[0] < FA_TILE_Q
    diffs = (live[1:] != live[:-1]).sum(axis=1)
    # Decoders differ from each other by their own cells; chunk rows by one cell, window rows
    # by two (one in, one out), so the runs are exactly the two chunks.
    assert (diffs[: DECODERS - 1] > 2).all()
    assert (diffs[DECODERS : DECODERS + len(CHUNK) - 1] == 1).all()
    swa = DECODERS + len(CHUNK)
    assert (diffs[swa : swa + len(SWA_ROWS) - 1] == 2).all()
    assert diffs[DECODERS - 1] > 2 and diffs[swa - 1] > 2
    assert live[:, N_KV // 64 * 64 :].any()  # the ragged last KV tile is read
    # Both runs read cells on either side of a span boundary; some chunk rows see none past it.
    for run in (chunk_rows(), swa_rows()):
        spans = {int(c) // SPAN for c in np.flatnonzero(run.any(axis=0))}
        assert len(spans) == 2, spans
    assert not chunk_rows()[0, SPAN:].any()


@pytest.mark.parametrize("n_threads", [1, 2])
def test_every_row_sees_exactly_its_cells(n_threads: int) -> None:
    live = step_rows()
    q, k, v = inputs(np.random.default_rng(21), len(live), exact=True)
    got = ggml_attention(q, k, v, live, n_threads)
    want, _ = reference(q, k, v, live)
    check(got, want, 4 * EPS32 * np.abs(want), f"exact, {n_threads} threads")


@pytest.mark.parametrize("n_threads", [1, 2])
def test_every_row_matches_softmax_attention(n_threads: int) -> None:
    live = step_rows()
    q, k, v = inputs(np.random.default_rng(22), len(live), exact=False)
    got = ggml_attention(q, k, v, live, n_threads)
    want, tol = reference(q, k, v, live)
    check(got, want, tol, f"softmax, {n_threads} threads")


@pytest.mark.parametrize("n_threads", [1, 2])
def test_the_runs_are_ggmls_tiled_kernel_and_decoders_keep_theirs(n_threads: int) -> None:
    live = step_rows()
    q, k, v = inputs(np.random.default_rng(23), len(live), exact=False)
    step = ggml_attention(q, k, v, live, n_threads)

    # Each run in a batch of 64 rows or more, where ggml tiles every row (upstream's choice),
    # padded with copies of its first row: a tile there sees the cells the run sees, so it
    # packs the same cells in the same order, and the run's rows come out bit for bit.
    for run in (CHUNK_ROWS, SWA_RUN_ROWS):
        pad = FA_TILE_Q - len(run)
        rows = run + [run[0]] * pad
        big = ggml_attention(q[rows], k, v, live[rows], n_threads)
        assert np.array_equal(step[run], big[: len(run)])

    # Each run alone in a batch: the decoders and their interleaved cells beside it change
    # none of its bits (a tile packs only cells that its rows see).
    for run in (CHUNK_ROWS, SWA_RUN_ROWS):
        assert np.array_equal(step[run], ggml_attention(q[run], k, v, live[run], n_threads))

    # Each row alone in a batch (a run row: the cells after its own come last in its run's
    # tiles; a decoder: upstream would split its cells by thread): the same bits.
    for r in [*RUN_ROWS[:4], *range(DECODERS)]:
        assert np.array_equal(step[r], ggml_attention(q[[r]], k, v, live[[r]], n_threads)[0])

    # The decoders alone, as in a step without the newcomer: the same bits.
    decoders = ggml_attention(q[:DECODERS], k, v, live[:DECODERS], n_threads)
    assert np.array_equal(step[:DECODERS], decoders)

    # With the path off, the per-query kernel rounds every row otherwise.
    pool = paths_process("none")
    per_query = pool.submit(ggml_attention, q, k, v, live, n_threads).result(timeout=600)
    assert not (step == per_query).all(axis=(1, 2)).any()

    # The threads share a run's spans out among them; the bits do not depend on how many.
    assert np.array_equal(step, ggml_attention(q, k, v, live, 3 - n_threads))


def test_the_comparisons_can_fail() -> None:
    """A reference with one cell of a run row lost, or one let in, is far outside the exact
    tolerance on the kernel's own output."""
    live = step_rows()
    q, k, v = inputs(np.random.default_rng(21), len(live), exact=True)
    got = ggml_attention(q, k, v, live, 1).astype(np.float64)
    tol = 4 * EPS32 * np.abs(reference(q, k, v, live)[0])
    row = DECODERS + 5
    lost = live.copy()
    lost[row, np.flatnonzero(live[row])[-1]] = False  # the row's own cell
    extra = live.copy()
    extra[row, np.flatnonzero(live[row])[-1] + 1] = True  # the next token's cell
    for wrong in (lost, extra):
        want = reference(q, k, v, wrong)[0]
        assert (np.abs(got - want) > 1000 * np.maximum(tol, 1e-30)).any()
