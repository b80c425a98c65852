"""The patched Q4_1 matrix product (scripts/patches/ggml-cpu-q4_1-cols.patch) against numpy.

test_batched_kernels.py shows that the patched kernels agree with ggml's own one-column
kernel in the same build; a mistake made in both would pass there. Here the reference shares
no code with ggml: the weight blocks are read from their bytes as ggml-common.h lays them out
(fp16 d and m, then 16 bytes of 4-bit quants: element j in the low nibble of byte j, element
j + 16 in the high one), the activations are quantized to Q8_1 as ggml's x86 code does it, and
each block's integer dot product is exact, accumulated in float64.

ggml computes the product as one graph on the CPU module the engine loads (ggml_graphs.py).
Where its gate (ggml-cpu-paths.patch) turns the Q4_1 paths on for this CPU, the patch routes
a 2-D Q4_1 x f32 product to them (elsewhere ggml's kernel computes it, held to the same
reference; the direct calls below reach both kernels everywhere): Q4_1 weights, activations
converted to Q8_1 and contiguous, no batch dimensions, no repacking (the tensors have no
backend buffer) and, for Q4_1, neither llamafile's sgemm nor ggml's tiled path (they cover
other types). Within a
16 x 16 tile, columns go 8 at a time to ggml_vec_dot_q4_1_q8_1_cols and a lone column goes to
ggml_vec_dot_q4_1_q8_1_rows, 4 weight rows at a time; both fall back to ggml's own kernel for
a width of one. The shapes below (1..9 columns, 1..5 rows and ragged larger counts, 1 and 2
threads) reach every width of both kernels and both fallbacks.

Tolerance. The quants and their integer dot products are exact on both sides, so the two
differ only in float32 rounding: of d_w * d_x per block, of the fused multiply-adds over the
blocks in 8 lanes, of the lanes' final sum and of the m * s terms. The standard bound for such
a sum of nb terms is about nb + 5 units of roundoff (2^-24) of the sum of the terms' absolute
values; we allow (nb + 10) * 2^-23 of it, about twice that bound. A real mistake (a row or
column off by one, a lost block or scale) is off by orders of magnitude more, which
test_the_tolerance_rejects_a_wrong_product checks on the kernel's own output.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from tests.conftest import real_model_path
from tests.engine.real.ggml_graphs import (
    GGML_TYPE_F32,
    GGML_TYPE_Q4_1,
    Graph,
    binary_symbols,
    cpu_module,
    ggml,
    require_avx2,
)

QK = 32  # elements per Q4_1 and per Q8_1 block
Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (QK // 2,))])
Q8_1_BLOCK = np.dtype([("d", "<f2"), ("s", "<f2"), ("qs", "i1", (QK,))])
# ggml's block_q4_1 and block_q8_1: no padding between the fields.
assert (Q4_1_BLOCK.itemsize, Q8_1_BLOCK.itemsize) == (20, 36)
EPS32 = 2.0**-23


@pytest.fixture(scope="module", autouse=True)
def avx2() -> None:
    require_avx2()


# --- the reference -------------------------------------------------------------------------


@dataclass(frozen=True)
class Blocks:
    """Quantized rows, one entry per (row, block): scale d, offset or sum term, quants."""

    d: np.ndarray  # float64 [rows, nb]
    extra: np.ndarray  # float64 [rows, nb]: Q4_1's m (min), Q8_1's s (d * sum of quants)
    q: np.ndarray  # int64 [rows, nb, 32]


def q4_1_blocks(raw: np.ndarray, k: int) -> Blocks:
    """Unpack Q4_1 rows from their bytes: a value is d * q + m, q in 0..15."""
    blocks = np.ascontiguousarray(raw).view(Q4_1_BLOCK).reshape(-1, k // QK)
    qs = blocks["qs"].astype(np.int64)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15, then 16..31
    return Blocks(blocks["d"].astype(np.float64), blocks["m"].astype(np.float64), q)


def q8_1_blocks(x: np.ndarray) -> Blocks:
    """Quantize float32 rows to Q8_1 as ggml's x86 quantize_row_q8_1 does, in float32: per
    block d = amax / 127, quants = round-half-even(x * (127 / amax)), s = d * sum(quants), with
    d and s stored as fp16. (The scalar reference code computes 1 / d and rounds halves away
    from zero instead, which could move a quant by one on exact ties.)"""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, QK)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    s = (d * q.sum(axis=-1).astype(np.float32)).astype(np.float16)
    return Blocks(d.astype(np.float16).astype(np.float64), s.astype(np.float64), q)


def q8_1_bytes(x: Blocks) -> np.ndarray:
    """Q8_1 rows as ggml stores them (d and s are fp16 values already: the cast is exact)."""
    blocks = np.zeros(x.d.shape, dtype=Q8_1_BLOCK)
    blocks["d"], blocks["s"], blocks["qs"] = x.d, x.extra, x.q
    return blocks.view(np.uint8).reshape(x.d.shape[0], -1)


@dataclass(frozen=True)
class Reference:
    out: np.ndarray  # float64 [columns, rows]: what the product is, given the quantization
    abs_sum: np.ndarray  # float64 [columns, rows]: sum of |terms| (the rounding error scale)
    nb: int

    @property
    def tolerance(self) -> np.ndarray:
        return (self.nb + 10) * EPS32 * self.abs_sum


def reference_product(w: Blocks, x: Blocks) -> Reference:
    """out[c, r] = sum over blocks b of d_w d_x (q_w . q_x) + m_w s_x, in float64."""
    dots = np.einsum("rbj,cbj->crb", w.q, x.q)  # exact integers
    abs_dots = np.einsum("rbj,cbj->crb", np.abs(w.q), np.abs(x.q))
    scale = w.d[None, :, :] * x.d[:, None, :]
    offset = w.extra[None, :, :] * x.extra[:, None, :]
    out = (scale * dots + offset).sum(axis=-1)
    abs_sum = (np.abs(scale) * abs_dots + np.abs(offset)).sum(axis=-1)
    return Reference(out, abs_sum, w.q.shape[1])


# --- ggml ----------------------------------------------------------------------------------


def ggml_product(
    w_raw: np.ndarray,
    rows: int,
    k: int,
    x: np.ndarray,
    n_threads: int,
    w_type: int = GGML_TYPE_Q4_1,
) -> np.ndarray:
    """W (rows x k, bytes of w_type: Q4_1 unless said) times the columns of x (columns x k,
    float32) computed by ggml, as float32 [columns, rows]."""
    with Graph(w_raw.nbytes + x.nbytes * 3 + rows * x.shape[0] * 4) as graph:
        w = graph.tensor(w_type, [k, rows], w_raw)
        xt = graph.tensor(GGML_TYPE_F32, [k, x.shape[0]], x.astype(np.float32))
        out = int(graph.g.base.ggml_mul_mat(graph.ctx, w, xt))
        # The conditions that route the product to the patched kernels.
        assert graph.head(w).type == w_type
        assert graph.head(w).buffer is None, "a weight in a backend buffer may be repacked"
        assert graph.op_name(out) == "MUL_MAT"
        assert list(graph.head(out).ne) == [rows, x.shape[0], 1, 1]
        return graph.compute(out, n_threads).reshape(x.shape[0], rows)


def random_q4_1(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Q4_1 blocks with the value ranges of real weights: d > 0, m about -8 d, any quants."""
    blocks = np.zeros(rows * (k // QK), dtype=Q4_1_BLOCK)
    d = rng.uniform(0.002, 0.03, blocks.shape)
    blocks["d"] = d
    blocks["m"] = -8 * d * rng.uniform(0.6, 1.4, blocks.shape)
    blocks["qs"] = rng.integers(0, 256, (*blocks.shape, QK // 2), dtype=np.uint8)
    return blocks.view(np.uint8)


def within(got: np.ndarray, ref: Reference, what: str) -> float:
    """got against ref elementwise; the worst error as a share of the tolerance (at most 1)."""
    share = np.abs(got.astype(np.float64) - ref.out) / ref.tolerance
    at = np.unravel_index(int(share.argmax()), share.shape)
    assert np.isfinite(got).all() and share.max() <= 1.0, (
        f"{what}: column {at[0]}, row {at[1]}: ggml {got[at]!r}, reference {ref.out[at]!r}, "
        f"tolerance {ref.tolerance[at]!r}"
    )
    return float(share.max())


def compare(w_raw: np.ndarray, rows: int, k: int, x: np.ndarray, n_threads: int) -> float:
    """ggml's product against the reference; returns the worst error as a share of the
    tolerance (fails when it is above 1)."""
    got = ggml_product(w_raw, rows, k, x, n_threads)
    ref = reference_product(q4_1_blocks(w_raw, k), q8_1_blocks(x))
    return within(got, ref, f"{rows} rows x {x.shape[0]} columns, k={k}, {n_threads} threads")


# --- which kernel each shape reaches ---------------------------------------------------------


def kernel_widths(rows: int, columns: int) -> set[tuple[str, int]]:
    """The (kernel, width) calls the patched branch makes for a product on one thread,
    following ggml_compute_forward_mul_mat's chunking (chunks of 16, or 64 for a vector,
    merged into one when there are fewer than 4) and the patch's walk over 16 x 16 tiles."""

    def spans(start: int, stop: int, step: int) -> list[tuple[int, int]]:
        return [(a, min(a + step, stop)) for a in range(start, stop, step)]

    chunk = 64 if rows == 1 or columns == 1 else 16
    n0, n1 = -(-rows // chunk), -(-columns // chunk)
    if n0 * n1 < 4:  # 4 chunks per thread at least, or one chunk per thread
        n0 = n1 = 1
    calls: set[tuple[str, int]] = set()
    for r_chunk in spans(0, rows, -(-rows // n0)):
        for c_chunk in spans(0, columns, -(-columns // n1)):
            for c_tile in spans(*c_chunk, 16):
                for r_tile in spans(*r_chunk, 16):
                    for c, c_stop in spans(*c_tile, 8):
                        if c_stop - c == 1:
                            calls |= {("rows", b - a) for a, b in spans(*r_tile, 4)}
                        else:
                            calls.add(("cols", c_stop - c))
    return calls


ROW_COUNTS = [1, 2, 3, 4, 5, 7, 16, 21, 38, 67]
COLUMN_COUNTS = list(range(1, 10))


def test_the_shapes_reach_every_width_of_both_kernels() -> None:
    reached = set().union(*(kernel_widths(r, c) for r in ROW_COUNTS for c in COLUMN_COUNTS))
    # Width 1 of either kernel is ggml's own kernel (the fallback of both).
    assert reached == {("cols", n) for n in range(2, 9)} | {("rows", n) for n in range(1, 5)}


# --- the tests -----------------------------------------------------------------------------


def test_the_loaded_cpu_module_carries_the_patched_q4_1_kernels() -> None:
    symbols = binary_symbols(cpu_module())
    missing = {"ggml_vec_dot_q4_1_q8_1_cols", "ggml_vec_dot_q4_1_q8_1_rows"} - symbols
    assert not missing, f"{cpu_module().name} lacks {missing}: not the patched build"
    assert "ggml-cpu-q4_1-cols" in ggml().backend.patches


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("k", [64, 576])
def test_random_q4_1_products_match_the_reference(n_threads: int, k: int) -> None:
    rng = np.random.default_rng(1000 * k + n_threads)
    worst = 0.0
    for rows in ROW_COUNTS:
        w_raw = random_q4_1(rng, rows, k)
        for columns in COLUMN_COUNTS:
            x = rng.standard_normal((columns, k)).astype(np.float32)
            worst = max(worst, compare(w_raw, rows, k, x, n_threads))
    print(f"k={k}, {n_threads} threads: worst error {worst:.3f} of the tolerance")


def test_the_patched_kernels_called_directly_match_the_reference() -> None:
    """The two kernels through their exported symbols, every width, with strides that are not
    the packed ones: a spare block of noise between rows or columns, and results 3 floats
    apart, so that a kernel that ignored a stride would read noise or write over a gap."""
    lib = ctypes.CDLL(str(cpu_module()))  # the module ggml loaded: the same handle
    p, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    cols = lib.ggml_vec_dot_q4_1_q8_1_cols  # (n, s, bs, vx, vy, by, nc)
    cols.restype, cols.argtypes = None, [i32, p, sz, p, p, sz, i32]
    rows = lib.ggml_vec_dot_q4_1_q8_1_rows  # (n, s, vx, bx, vy, nr)
    rows.restype, rows.argtypes = None, [i32, p, p, sz, p, i32]

    rng = np.random.default_rng(5)
    k = 160  # 5 blocks per row
    w_raw = random_q4_1(rng, 4, k).reshape(4, -1)
    x = rng.standard_normal((8, k)).astype(np.float32)
    xq = q8_1_blocks(x)
    ref = reference_product(q4_1_blocks(w_raw, k), xq)
    w_spaced = np.hstack([w_raw, rng.integers(0, 256, (4, Q4_1_BLOCK.itemsize), np.uint8)])
    x_spaced = np.hstack([q8_1_bytes(xq), rng.integers(0, 256, (8, Q8_1_BLOCK.itemsize), np.uint8)])
    worst = 0.0
    for nc in range(1, 9):  # weight row 0 against columns 0..nc-1
        out = np.full((nc, 3), np.nan, dtype=np.float32)
        cols(
            k, out.ctypes.data, 3, w_spaced.ctypes.data, x_spaced.ctypes.data, x_spaced.shape[1], nc
        )
        assert np.isnan(out[:, 1:]).all(), f"_cols with {nc} columns wrote between its results"
        sub = Reference(ref.out[:nc, :1], ref.abs_sum[:nc, :1], ref.nb)
        worst = max(worst, within(out[:, :1], sub, f"_cols, {nc} columns"))
    for nr in range(1, 5):  # column 0 against weight rows 0..nr-1
        row_out = np.full(5, np.nan, dtype=np.float32)
        rows(
            k,
            row_out.ctypes.data,
            w_spaced.ctypes.data,
            w_spaced.shape[1],
            x_spaced.ctypes.data,
            nr,
        )
        assert np.isnan(row_out[nr:]).all(), f"_rows with {nr} rows wrote past its results"
        sub = Reference(ref.out[:1, :nr], ref.abs_sum[:1, :nr], ref.nb)
        worst = max(worst, within(row_out[None, :nr], sub, f"_rows, {nr} rows"))
    print(f"direct calls: worst error {worst:.3f} of the tolerance")

    # And the check sees a stride ignored: told the packed column stride, the kernel reads
    # columns 1..7 shifted into the noise, and every one of them is outside the tolerance
    # (NaN included: noise bytes can make an fp16 scale NaN).
    out = np.full((8, 3), np.nan, dtype=np.float32)
    packed = x_spaced.shape[1] - Q8_1_BLOCK.itemsize
    cols(k, out.ctypes.data, 3, w_spaced.ctypes.data, x_spaced.ctypes.data, packed, 8)
    share = np.abs(out[:, 0] - ref.out[:, 0]) / ref.tolerance[:, 0]
    assert share[0] <= 1.0 and not (share[1:] <= 1.0).any(), share


SMOLLM2 = "smollm2-135m-instruct-q4_1"
# An attention projection (576 -> 576), the narrow K projection (576 -> 192, three KV heads)
# and an FFN down projection (1536 -> 576, 48 blocks per row), from the first and last layers.
SMOLLM2_TENSORS = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.29.ffn_down.weight"]


@pytest.fixture(scope="module")
def smollm2_weights() -> Iterator[Callable[[str], tuple[np.ndarray, int, int]]]:
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(real_model_path(SMOLLM2))
    tensors = {t.name: t for t in reader.tensors}

    def weight(name: str) -> tuple[np.ndarray, int, int]:
        t = tensors[name]
        assert t.tensor_type == GGMLQuantizationType.Q4_1, f"{name} is {t.tensor_type.name}"
        k, rows = (int(n) for n in t.shape)  # ggml order: ne[0] = k
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        assert raw.size == rows * (k // QK) * Q4_1_BLOCK.itemsize
        return raw, rows, k

    yield weight


@pytest.mark.real_model
@pytest.mark.parametrize("name", SMOLLM2_TENSORS)
def test_smollm2_q4_1_weights_match_the_reference(
    name: str, smollm2_weights: Callable[[str], tuple[np.ndarray, int, int]]
) -> None:
    w_raw, rows, k = smollm2_weights(name)
    rng = np.random.default_rng(7)
    worst = 0.0
    for n_threads in (1, 2):
        for columns in COLUMN_COUNTS:  # a decode step of 1..9 sessions
            x = rng.standard_normal((columns, k)).astype(np.float32)
            worst = max(worst, compare(w_raw, rows, k, x, n_threads))
    print(f"{name} ({rows} x {k}): worst error {worst:.3f} of the tolerance")


@dataclass(frozen=True)
class Broken:
    """A wrong product, made from the right blocks: the mistakes a batched kernel could make."""

    name: str
    product: Callable[[Blocks, Blocks], np.ndarray]


def _shift_rows(w: Blocks, x: Blocks) -> np.ndarray:
    rolled = Blocks(np.roll(w.d, 1, 0), np.roll(w.extra, 1, 0), np.roll(w.q, 1, 0))
    return reference_product(rolled, x).out


def _shift_columns(w: Blocks, x: Blocks) -> np.ndarray:
    return np.roll(reference_product(w, x).out, 1, axis=0)


def _no_min(w: Blocks, x: Blocks) -> np.ndarray:
    return reference_product(Blocks(w.d, np.zeros_like(w.extra), w.q), x).out


def _last_block_lost(w: Blocks, x: Blocks) -> np.ndarray:
    cut = Blocks(w.d[:, :-1], w.extra[:, :-1], w.q[:, :-1])
    return reference_product(cut, Blocks(x.d[:, :-1], x.extra[:, :-1], x.q[:, :-1])).out


def _nibbles_swapped(w: Blocks, x: Blocks) -> np.ndarray:
    swapped = np.concatenate([w.q[..., 16:], w.q[..., :16]], axis=-1)
    return reference_product(Blocks(w.d, w.extra, swapped), x).out


BROKEN = [
    Broken("row off by one", _shift_rows),
    Broken("column off by one", _shift_columns),
    Broken("min term dropped", _no_min),
    Broken("last block lost", _last_block_lost),
    Broken("nibble halves swapped", _nibbles_swapped),
]


@pytest.mark.parametrize("broken", BROKEN, ids=[b.name for b in BROKEN])
def test_the_tolerance_rejects_a_wrong_product(broken: Broken) -> None:
    """The comparison can fail: on the kernel's own output for a 5-row, 9-column product (both
    kernels and both fallbacks on one thread), the right reference is within the tolerance
    and each wrong one is outside it by far."""
    rng = np.random.default_rng(3)
    rows, k = 5, 96
    w_raw = random_q4_1(rng, rows, k)
    x = rng.standard_normal((9, k)).astype(np.float32)
    got = ggml_product(w_raw, rows, k, x, 1)
    assert_rejects(got, q4_1_blocks(w_raw, k), q8_1_blocks(x), broken)


def assert_rejects(got: np.ndarray, w: Blocks, x: Blocks, broken: Broken) -> None:
    """ggml's product got is within the tolerance of the right reference, and the broken one
    is outside it by far."""
    ref = reference_product(w, x)
    assert (np.abs(got.astype(np.float64) - ref.out) <= ref.tolerance).all()
    off = np.abs(got - broken.product(w, x)) / ref.tolerance
    assert off.max() > 100, f"{broken.name}: only {off.max():.1f} times the tolerance"
