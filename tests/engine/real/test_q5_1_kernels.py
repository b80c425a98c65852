"""The batched Q5_1 kernel (scripts/patches/ggml-cpu-q5_1-cols.patch) against numpy and against
ggml's own one-column kernel.

Q5_1 has no batched path on x86 in this llama.cpp (no repacking, no llamafile sgemm), so a
step of n tokens ran ggml_vec_dot_q5_1_q8_1 n times per weight row. The patch adds
ggml_vec_dot_q5_1_q8_1_cols, which rebuilds a weight block's 5-bit quants once for up to 8
columns and keeps the one-column kernel's operations per column (path q5_1_cols, where the
gate turns it on; a lone column stays on ggml's kernel).

References that share none of the patch:

* ggml's ggml_vec_dot_q5_1_q8_1, called one column at a time through its exported symbol,
  must equal the batched kernel bit for bit, at every width and with strides that are not the
  packed ones;
* a numpy product over blocks read from their bytes as ggml-common.h lays them out (fp16 d and
  m, 4 bytes of fifth bits, 16 bytes of nibbles: element j is the low nibble of byte j plus bit
  j of qh times 16, element j + 16 the high nibble plus bit j + 16), with activations
  quantized to Q8_1 as ggml's x86 code does it (test_q4_1_kernel_reference.py, whose tolerance
  this shares); the product goes through ggml's graph on the CPU module the engine loads, so
  where the gate has the path on it reaches the patched kernel and elsewhere ggml's own;
* a real Q5_1 model's batched decode step against the same tokens one at a time
  (test_batched_kernels.py runs SmolLM2 quantized to Q5_1 too).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tests.engine.real import test_q4_1_kernel_reference as q4_1_tests
from tests.engine.real.ggml_graphs import (
    GGML_TYPE_Q5_1,
    binary_symbols,
    cpu_module,
    ggml,
    loaded_paths,
    require_avx2,
)
from tests.engine.real.test_q4_1_kernel_reference import (
    COLUMN_COUNTS,
    Q8_1_BLOCK,
    QK,
    Blocks,
    Reference,
    q8_1_blocks,
    q8_1_bytes,
    reference_product,
    within,
)

Q5_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", (QK // 2,))])
assert Q5_1_BLOCK.itemsize == 24  # ggml's block_q5_1: no padding between the fields
ROW_COUNTS = [1, 2, 3, 5, 16, 21, 38]
P, SZ, I32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int


@pytest.fixture(scope="module", autouse=True)
def avx2() -> None:
    require_avx2()


def five_bit_values(blocks: np.ndarray) -> np.ndarray:
    """The 5-bit values 0..31 of Q5_0 or Q5_1 blocks (fields qs and qh): element j is the low
    nibble of byte j (j < 16) or the high nibble of byte j - 16, plus 16 times bit j of qh."""
    qs = blocks["qs"].astype(np.int64)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15, then 16..31
    bits = (blocks["qh"].astype(np.int64)[..., None] >> np.arange(QK)) & 1
    result: np.ndarray = low | bits << 4
    return result


def q5_1_blocks(raw: np.ndarray, k: int) -> Blocks:
    """Unpack Q5_1 rows from their bytes: a value is d * q + m, q in 0..31."""
    blocks = np.ascontiguousarray(raw).view(Q5_1_BLOCK).reshape(-1, k // QK)
    d, m = blocks["d"].astype(np.float64), blocks["m"].astype(np.float64)
    return Blocks(d, m, five_bit_values(blocks))


def random_q5_1(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Q5_1 blocks with the value ranges of real weights: d > 0, m about -16 d, any quants."""
    blocks = np.zeros(rows * (k // QK), dtype=Q5_1_BLOCK)
    d = rng.uniform(0.001, 0.015, blocks.shape)
    blocks["d"] = d
    blocks["m"] = -16 * d * rng.uniform(0.6, 1.4, blocks.shape)
    blocks["qh"] = rng.integers(0, 2**32, blocks.shape, dtype=np.uint64).astype(np.uint32)
    blocks["qs"] = rng.integers(0, 256, (*blocks.shape, QK // 2), dtype=np.uint8)
    return blocks.view(np.uint8)


def ggml_product(w_raw: np.ndarray, rows: int, k: int, x: np.ndarray, n_threads: int) -> np.ndarray:
    """W (rows x k, Q5_1 bytes) times x's columns, by ggml (float32 [columns, rows])."""
    return q4_1_tests.ggml_product(w_raw, rows, k, x, n_threads, GGML_TYPE_Q5_1)


def kernels() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    """(ggml's one-column kernel, the patched columns kernel) from the module ggml loaded."""
    lib = ctypes.CDLL(str(cpu_module()))  # the same handle ggml holds
    one = lib.ggml_vec_dot_q5_1_q8_1  # (n, s, bs, vx, bx, vy, by, nrc)
    one.restype, one.argtypes = None, [I32, P, SZ, P, SZ, P, SZ, I32]
    cols = lib.ggml_vec_dot_q5_1_q8_1_cols  # (n, s, bs, vx, vy, by, nc)
    cols.restype, cols.argtypes = None, [I32, P, SZ, P, P, SZ, I32]
    return one, cols


def test_the_loaded_cpu_module_carries_the_q5_1_kernel() -> None:
    symbols = binary_symbols(cpu_module())
    assert "ggml_vec_dot_q5_1_q8_1_cols" in symbols, f"{cpu_module().name}: not the patched build"
    assert "ggml-cpu-q5_1-cols" in ggml().backend.patches


def test_the_reference_unpacks_the_fifth_bit() -> None:
    """One hand-made block: quants 0..31 in order need every qh bit where the value is >= 16."""
    block = np.zeros(1, dtype=Q5_1_BLOCK)
    block["d"], block["m"] = 0.5, -1.0
    want = np.arange(QK)
    block["qs"] = (want[:16] & 0x0F) | (want[16:] & 0x0F) << 4
    block["qh"] = sum(1 << j for j in range(QK) if want[j] >= 16)
    got = q5_1_blocks(block.view(np.uint8), QK)
    assert got.q[0, 0].tolist() == want.tolist()
    assert (got.d.item(), got.extra.item()) == (0.5, -1.0)


def test_the_columns_kernel_equals_ggml_one_column_at_a_time() -> None:
    """Every width 1..8, with a spare block of noise after each column and results 3 floats
    apart: a kernel that ignored a stride would read noise or write over the gap."""
    one, cols = kernels()
    rng = np.random.default_rng(11)
    k = 192  # 6 blocks per row
    w_raw = random_q5_1(rng, 1, k)
    xq = q8_1_blocks(rng.standard_normal((8, k)).astype(np.float32))
    noise = rng.integers(0, 256, (8, Q8_1_BLOCK.itemsize), np.uint8)
    x_spaced = np.ascontiguousarray(np.hstack([q8_1_bytes(xq), noise]))
    single = np.zeros(8, dtype=np.float32)
    for c in range(8):
        row = np.ascontiguousarray(x_spaced[c])
        one(k, single[c:].ctypes.data, 0, w_raw.ctypes.data, 0, row.ctypes.data, 0, 1)
    ref = reference_product(q5_1_blocks(w_raw, k), xq)
    within(single[:, None], Reference(ref.out[:, :1], ref.abs_sum[:, :1], ref.nb), "ggml")
    for nc in range(1, 9):
        out = np.full((nc, 3), np.nan, dtype=np.float32)
        cols(k, out.ctypes.data, 3, w_raw.ctypes.data, x_spaced.ctypes.data, x_spaced.shape[1], nc)
        assert np.isnan(out[:, 1:]).all(), f"{nc} columns: wrote between its results"
        assert np.array_equal(out[:, 0], single[:nc]), (nc, out[:, 0], single[:nc])


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("k", [64, 576])
def test_random_q5_1_products_match_the_reference(n_threads: int, k: int) -> None:
    rng = np.random.default_rng(100 * k + n_threads)
    worst = 0.0
    for rows in ROW_COUNTS:
        w_raw = random_q5_1(rng, rows, k)
        for columns in COLUMN_COUNTS:  # a decode step of 1..9 sessions
            x = rng.standard_normal((columns, k)).astype(np.float32)
            got = ggml_product(w_raw, rows, k, x, n_threads)
            ref = reference_product(q5_1_blocks(w_raw, k), q8_1_blocks(x))
            what = f"{rows} rows x {columns} columns, k={k}, {n_threads} threads"
            worst = max(worst, within(got, ref, what))
    on = "q5_1_cols" in loaded_paths()
    print(f"k={k}, {n_threads} threads, path {'on' if on else 'off'}: worst {worst:.3f}")


def _fifth_bit_lost(w: Blocks, x: Blocks) -> np.ndarray:
    return reference_product(Blocks(w.d, w.extra, w.q & 0x0F), x).out


BROKEN = [*q4_1_tests.BROKEN, q4_1_tests.Broken("fifth bit lost", _fifth_bit_lost)]


@pytest.mark.parametrize("broken", BROKEN, ids=[b.name for b in BROKEN])
def test_the_tolerance_rejects_a_wrong_product(broken: q4_1_tests.Broken) -> None:
    """On the kernel's own output (9 columns: 8 batched and one alone, on one thread), the
    right reference is within the tolerance and each wrong one is far outside it."""
    rng = np.random.default_rng(4)
    rows, k = 5, 96
    w_raw = random_q5_1(rng, rows, k)
    x = rng.standard_normal((9, k)).astype(np.float32)
    got = ggml_product(w_raw, rows, k, x, 1)
    q4_1_tests.assert_rejects(got, q5_1_blocks(w_raw, k), q8_1_blocks(x), broken)
