"""The patched CPU flash attention (scripts/patches/ggml-cpu-fa-live-cells.patch) against numpy.

The patch changes which cells the kernel visits and in what grouping: it gathers a query's
live cells (mask not -inf) 256 at a time, passing over words of four fully masked cells at
once and testing a partial word (a chunk's last cells) one cell at a time, and prefetches
the rows of the cell four ahead. The arithmetic per visited cell is upstream's. A mistake
would show as a cell lost or a masked cell let in, most likely at the edges: a block of 256,
a word that is partly live, the ragged tail of a chunk.

ggml_flash_attn_ext runs as a one-op graph on the CPU module the engine loads
(ggml_graphs.py), with F16 K and V as in the engine's cache, four query heads over two KV
heads (grouped-query attention, as SmolLM2) and a mask shaped like a unified cache's: a prefix
shared by three sequences, five sequences' cells interleaved one in five after it, a fully
masked query row and a query whose few cells sit on block and word edges. It runs in a child
process with PolyKV's kernel paths off: where the fa_runs path runs (test_flash_attn_runs.py),
it takes every row under 64 to ggml's tiled kernel, and this kernel runs on the CPUs where it
does not. The kernel reaches the patched function on two paths, and both are run, on 1 and 2
threads:
  * several query rows (fewer than GGML_FA_TILE_Q = 64, else ggml takes its tiled kernel):
    each row scans all cells;
  * one query row over 512 cells or more: the cells are split into one chunk per thread (here
    707 cells: 0..353 and 354..706, the second starting mid-word) and the partials merged.

Two references, both float64 numpy softmax attention over the live cells:
  * exact: Q = 0, so every live cell weighs exactly 1, and V holds small integers, so ggml's
    fp16 accumulator sums them without rounding. The output is the mean of the live cells' V
    rows, to float32 rounding of the last division; any lost or extra cell moves it by about
    1/n of a V value (n live cells), thousands of times the tolerance;
  * softmax: random Q, K, V. ggml accumulates V in fp16 (one rounding per visited cell), so
    the tolerance is that rounding's bound, computed per output from the reference itself:
    2 u16 sum_t R_t / S, where u16 = 2^-11, S is the softmax denominator and R_t bounds the
    running weighted sum of V after cell t from any chunk start (see fp16_bound), plus float32
    terms for the scores, exponentials and sums. The patch leaves that arithmetic as upstream
    wrote it; this check shows that the patched kernel still computes softmax attention, on
    every path, within its own rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from tests.engine.real.ggml_graphs import (
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    Graph,
    cpu_module,
    disassembly,
    ggml,
    loaded_paths,
    paths_process,
    require_avx2,
)

HEAD_DIM = 64
N_HEAD, N_HEAD_KV = 4, 2
SCALE = HEAD_DIM**-0.5
N_KV = 707
FA_TILE_Q = 64  # GGML_FA_TILE_Q: from this many query rows on, ggml uses its tiled kernel
SPLIT_MIN_KV = 512  # one query row over this many cells takes the split (per-thread) path
EPS32 = 2.0**-23
U16 = 2.0**-11  # unit roundoff of fp16
PREFIX = 300  # cells 0..299 are shared by sequences 0, 1 and 2


@pytest.fixture(scope="module", autouse=True)
def avx2() -> None:
    require_avx2()


def live_cells() -> np.ndarray:
    """Which cells each of 7 query rows sees, bool [7, N_KV]: rows 0..4 are the next tokens of
    sequences 0..4, row 5 sees nothing (a padding row), row 6 a few cells on edges."""
    live = np.zeros((7, N_KV), dtype=bool)
    live[0:3, :PREFIX] = True
    owner = (np.arange(N_KV) - PREFIX) % 5  # cells after the prefix: one in five per sequence
    rank = (np.arange(N_KV) - PREFIX) // 5  # position of the cell in its sequence
    lengths = [80, 82, 40, 7, 1]  # how far each sequence has got (its later cells are free)
    for s, n in enumerate(lengths):
        live[s, PREFIX:] = (owner[PREFIX:] == s) & (rank[PREFIX:] < n)
    # Row 6: both sides of the 4-cell words, the 256-cell block and the thread split (354),
    # and the last cells, which fall in the partial word at the end of the scan.
    live[6, [1, 2, 3, 4, 255, 256, 257, 352, 353, 354, 355, 699, 704, 706]] = True
    return live


def mask_of(live: np.ndarray) -> np.ndarray:
    return np.where(live, 0.0, -np.inf).astype(np.float16)


# --- the reference -------------------------------------------------------------------------


@dataclass(frozen=True)
class Attention:
    out: np.ndarray  # float64 [rows, heads, HEAD_DIM]
    tolerance: np.ndarray  # float64, the same shape


def fp16_bound(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The fp16 accumulation error bound over the live cells in scan order, in units of the
    unnormalised output: each step rounds the accumulator, whose value is the weighted sum of
    V since the chunk's start (P_t - P_u for a chunk starting after cell u), and a rescale
    rounds it once more, so the error is at most 2 u16 sum_t R_t with R_t = max_u |P_t - P_u|
    over every possible chunk start; plus fp16's absolute precision near zero (2^-25) per step."""
    cum = np.vstack([np.zeros((1, v.shape[1])), np.cumsum(p[:, None] * v, axis=0)])
    low = np.minimum.accumulate(cum, axis=0)[:-1]  # over the starts before each cell
    high = np.maximum.accumulate(cum, axis=0)[:-1]
    reach = np.maximum(cum[1:] - low, high - cum[1:])
    bound: np.ndarray = 2 * U16 * reach.sum(axis=0) + 2 * len(p) * 2.0**-25
    return bound


def reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, live: np.ndarray, kv_head: Callable[[int], int]
) -> Attention:
    """Softmax attention in float64 over each row's live cells. q [rows, heads, d] is rounded
    to fp16 first: ggml converts Q to K's type (F16) for the K dot products."""
    q16 = q.astype(np.float16).astype(np.float64)
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    out = np.zeros(q.shape)
    tol = np.zeros(q.shape)
    for i in range(q.shape[0]):
        cells = np.flatnonzero(live[i])
        if cells.size == 0:
            continue  # ggml writes zeros for a row that sees no cell
        for h in range(q.shape[1]):
            kh, vh = k64[kv_head(h), cells], v64[kv_head(h), cells]
            s = SCALE * (kh @ q16[i, h])
            p = np.exp(s - s.max())
            denom = p.sum()
            out[i, h] = p @ vh / denom
            # float32 terms: each score's dot product (HEAD_DIM products), each weight's
            # exponential and rescalings, the denominator and the last division.
            score_err = SCALE * HEAD_DIM * EPS32 * (np.abs(kh) @ np.abs(q16[i, h])).max()
            weight_err = 2 * score_err + (cells.size + 8) * EPS32
            spread = np.abs(vh - out[i, h]).max(axis=0)
            tol[i, h] = (
                fp16_bound(p, vh) / denom
                + 2 * weight_err * spread
                + (cells.size + 4) * EPS32 * np.abs(out[i, h])
            )
    return Attention(out, tol)


def gqa(h: int) -> int:
    return h // (N_HEAD // N_HEAD_KV)  # ggml: query head h reads KV head h / (heads per KV)


# --- ggml ----------------------------------------------------------------------------------


def ggml_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, live: np.ndarray, n_threads: int
) -> np.ndarray:
    """ggml_flash_attn_ext on q [rows, heads, d] (F32), k and v [kv heads, cells, d] (F16),
    with live's mask; float32 [rows, heads, d]. Computed in a process with every kernel path
    off: the fa_runs path (test_flash_attn_runs.py) takes every row under 64 where it runs."""
    pool = paths_process("none")
    return pool.submit(attention_here, q, k, v, live, n_threads).result(timeout=600)


def attention_here(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, live: np.ndarray, n_threads: int
) -> np.ndarray:
    rows = q.shape[0]
    mask = mask_of(live)
    size = q.nbytes + k.nbytes + v.nbytes + mask.nbytes + q.nbytes
    with Graph(size) as graph:
        # ggml's q is [d, rows, heads]: numpy's [heads, rows, d].
        qt = graph.tensor(GGML_TYPE_F32, [HEAD_DIM, rows, N_HEAD], q.transpose(1, 0, 2))
        kt = graph.tensor(GGML_TYPE_F16, [HEAD_DIM, N_KV, N_HEAD_KV], k)
        vt = graph.tensor(GGML_TYPE_F16, [HEAD_DIM, N_KV, N_HEAD_KV], v)
        mt = graph.tensor(GGML_TYPE_F16, [N_KV, rows], mask)
        out = int(graph.g.base.ggml_flash_attn_ext(graph.ctx, qt, kt, vt, mt, SCALE, 0.0, 0.0))
        assert graph.op_name(out) == "FLASH_ATTN_EXT"
        assert list(graph.head(out).ne) == [HEAD_DIM, N_HEAD, rows, 1]
        return graph.compute(out, n_threads).reshape(rows, N_HEAD, HEAD_DIM)


@dataclass(frozen=True)
class Case:
    """One kernel run: which query rows, and the path through the kernel they take."""

    name: str
    rows: list[int]


CASES = [
    Case("7 rows, each scans every cell", list(range(7))),
    Case("1 row of 380 cells, split by thread", [0]),
    Case("1 row of 7 cells, split by thread", [3]),
    Case("1 row on the edges, split by thread", [6]),
    Case("1 row of no cell, split by thread", [5]),
]


def path_of(rows: int) -> str:
    assert rows < FA_TILE_Q, "the tiled kernel (not patched) would take this many rows"
    return "split" if rows == 1 and N_KV >= SPLIT_MIN_KV else "rows"


def inputs(rng: np.random.Generator, exact: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = rng.standard_normal((N_HEAD_KV, N_KV, HEAD_DIM)).astype(np.float16)
    if exact:
        # Q = 0: every score is 0, every live cell weighs exactly 1. V in -2..2: the fp16
        # running sums stay integers below 2048 (exact) for up to 1024 cells.
        q = np.zeros((7, N_HEAD, HEAD_DIM), dtype=np.float32)
        v = rng.integers(-2, 3, (N_HEAD_KV, N_KV, HEAD_DIM)).astype(np.float16)
    else:
        q = (2 * rng.standard_normal((7, N_HEAD, HEAD_DIM))).astype(np.float32)
        v = rng.standard_normal((N_HEAD_KV, N_KV, HEAD_DIM)).astype(np.float16)
    return q, k, v


def exact_tolerance(out: np.ndarray) -> np.ndarray:
    # The sums and the count are exact; the last step multiplies by 1/S in float32.
    tol: np.ndarray = 4 * EPS32 * np.abs(out)
    return tol


def check(got: np.ndarray, want: np.ndarray, tol: np.ndarray, what: str) -> float:
    err = np.abs(got.astype(np.float64) - want)
    assert np.isfinite(got).all(), what
    bad = err > tol
    if bad.any():
        i, h, d = np.argwhere(bad)[0]
        pytest.fail(
            f"{what}: row {i}, head {h}, dim {d}: ggml {got[i, h, d]!r}, reference "
            f"{want[i, h, d]!r}, tolerance {tol[i, h, d]!r} ({int(bad.sum())} outputs off)"
        )
    return float(err.max())


# --- the tests -----------------------------------------------------------------------------


def test_the_loaded_cpu_module_carries_the_patched_flash_attention() -> None:
    # The patch's word test XORs four fp16 -inf (0xFC00) at once: the constant is its mark.
    assert "0xfc00fc00fc00fc00" in disassembly(cpu_module()), (
        f"{cpu_module().name} has no live-cell scan: not the patched build"
    )
    assert "ggml-cpu-fa-live-cells" in ggml().backend.patches


def test_the_kernel_runs_with_the_attention_path_off() -> None:
    assert "fa_runs" not in paths_process("none").submit(loaded_paths).result(timeout=600)


def test_the_mask_covers_the_edges() -> None:
    live = live_cells()
    counts = live.sum(axis=1)
    assert counts[0] > 256 and counts[5] == 0  # a second gathered block; a row of nothing
    words = live.reshape(7, -1)[:, : N_KV // 4 * 4].reshape(7, -1, 4)
    assert (~words[0:5].any(axis=-1)).any(axis=-1).all()  # fully masked words in every scan
    assert (words.any(axis=-1) & ~words.all(axis=-1)).any()  # partly live words
    assert N_KV % 4 != 0 and live[:, N_KV // 4 * 4 :].any()  # live cells in the ragged tail


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_flash_attention_visits_exactly_the_live_cells(case: Case, n_threads: int) -> None:
    q, k, v = inputs(np.random.default_rng(11), exact=True)
    live = live_cells()[case.rows]
    assert path_of(len(case.rows)) == ("split" if len(case.rows) == 1 else "rows")
    got = ggml_attention(q[case.rows], k, v, live, n_threads)
    want = reference(q[case.rows], k, v, live, gqa).out
    err = check(got, want, exact_tolerance(want), f"{case.name}, {n_threads} threads")
    print(f"exact, {case.name}, {n_threads} threads: max error {err:.3g}")


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_flash_attention_matches_softmax_attention(case: Case, n_threads: int) -> None:
    q, k, v = inputs(np.random.default_rng(12), exact=False)
    live = live_cells()[case.rows]
    got = ggml_attention(q[case.rows], k, v, live, n_threads)
    ref = reference(q[case.rows], k, v, live, gqa)
    err = check(got, ref.out, ref.tolerance, f"{case.name}, {n_threads} threads")
    share = float((np.abs(got - ref.out) / np.maximum(ref.tolerance, 1e-300)).max())
    print(f"softmax, {case.name}, {n_threads} threads: max error {err:.3g}, {share:.3f} of tol")


def test_both_paths_run() -> None:
    """Evidence that the split path ran: on 2 threads a long single row is summed in two
    chunks and merged, which rounds differently from one pass (1 thread), while the row path
    gives each row to one thread, so its results do not depend on the thread count."""
    q, k, v = inputs(np.random.default_rng(12), exact=False)
    live = live_cells()
    one, two = (ggml_attention(q[[0]], k, v, live[[0]], n) for n in (1, 2))
    assert not np.array_equal(one, two), "2 threads computed the long row in one pass"
    one, two = (ggml_attention(q, k, v, live, n) for n in (1, 2))
    assert np.array_equal(one, two)


# --- the comparisons can fail ----------------------------------------------------------------


def _drop(row: int, nth_live: int) -> Callable[[np.ndarray], np.ndarray]:
    def broken(live: np.ndarray) -> np.ndarray:
        live = live.copy()
        live[row, np.flatnonzero(live[row])[nth_live]] = False
        return live

    return broken


def _let_in(row: int, cell: int) -> Callable[[np.ndarray], np.ndarray]:
    def broken(live: np.ndarray) -> np.ndarray:
        assert not live[row, cell]
        live = live.copy()
        live[row, cell] = True
        return live

    return broken


def _shift(row: int) -> Callable[[np.ndarray], np.ndarray]:
    def broken(live: np.ndarray) -> np.ndarray:
        live = live.copy()
        live[row] = np.roll(live[row], 1)
        return live

    return broken


WRONG_CELLS = {
    "first cell of the second block lost": _drop(0, 256),
    "last cell of the first block lost": _drop(0, 255),
    "tail cell lost": _drop(6, -1),
    "cell of a partly live word lost": _drop(6, 0),
    "another sequence's cell let in": _let_in(3, PREFIX + 1),
    "a cell of a fully masked word let in": _let_in(4, 0),
    "cells off by one": _shift(6),
}


@pytest.mark.parametrize("wrong", list(WRONG_CELLS), ids=list(WRONG_CELLS))
def test_the_exact_comparison_rejects_a_wrong_cell(wrong: str) -> None:
    """On the kernel's own output for all 7 rows, a reference that visits one cell too few or
    too many, or the right count of cells one off, is outside the tolerance by far."""
    q, k, v = inputs(np.random.default_rng(11), exact=True)
    live = live_cells()
    got = ggml_attention(q, k, v, live, 1).astype(np.float64)
    want = reference(q, k, v, WRONG_CELLS[wrong](live), gqa).out
    tol = exact_tolerance(reference(q, k, v, live, gqa).out)
    assert (np.abs(got - want) > 1000 * np.maximum(tol, 1e-30)).any(), wrong


def test_the_softmax_comparison_rejects_wrong_attention() -> None:
    """The same for the softmax reference: the wrong KV head for a query head, no scale, or
    the heaviest cell of a row lost put some outputs outside the tolerance."""
    q, k, v = inputs(np.random.default_rng(12), exact=False)
    live = live_cells()
    got = ggml_attention(q, k, v, live, 1).astype(np.float64)
    right = reference(q, k, v, live, gqa)
    assert (np.abs(got - right.out) <= right.tolerance).all()
    wrong_head = reference(q, k, v, live, lambda h: h % N_HEAD_KV).out
    assert (np.abs(got - wrong_head) > right.tolerance).any()
    unscaled = reference(q / SCALE, k, v, live, gqa).out
    assert (np.abs(got - unscaled) > right.tolerance).any()
    heaviest = live.copy()
    cells = np.flatnonzero(live[3])
    scores = k[0, cells].astype(np.float64) @ q[3, 0].astype(np.float64)
    heaviest[3, cells[scores.argmax()]] = False
    lost = reference(q, k, v, heaviest, gqa).out
    assert (np.abs(got - lost) > right.tolerance).any()
