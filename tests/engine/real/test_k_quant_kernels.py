"""The batched kernels for Q4_K_M's two K-quants (scripts/patches/ggml-cpu-q4_K_M-cols.patch).

On x86 this llama.cpp repacks Q4_K weights and multiplies them 4 tokens at a time in
ggml_gemm_q4_K_8x8_q8_K; the 1..3 tokens left over each ran ggml_gemv_q4_K_8x8_q8_K, which
unpacks every weight group again. Q6_K has no batched path at all there (no repacking, no
llamafile sgemm; ggml's tiled K-quant path starts at 8 tokens): 2..7 tokens ran
ggml_vec_dot_q6_K_q8_K once each per weight row. The patch adds ggml_gemv_q4_K_8x8_q8_K_cols
(2..3 leftover tokens at once) and ggml_vec_dot_q6_K_q8_K_cols (up to 8 tokens at once), each
keeping the one-token kernel's operations per (row, token).

References that share none of the patch: ggml's own one-token kernels (called one token at a
time through their exported symbols, they must match the batched ones bit for bit), a numpy
Q6_K x Q8_K product over blocks read from their bytes, and a real Q4_K_M model whose decode
step of 2 or 3 sessions must equal the same tokens decoded one at a time. Activations for the
numpy reference are whole numbers in [-127, 127] with -127 in every block: ggml quantizes those
to Q8_K exactly (scale 1, the quants are the numbers), so the reference needs no copy of
ggml's quantizer. Tolerance as in test_q4_1_kernel_reference.py: (nb + 10) * 2^-23 of the sum
of the terms' absolute values.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from polykv_engine.llama.runtime import Batch, LlamaRuntime, RuntimeConfig
from tests.conftest import real_model_path
from tests.engine.real.ggml_graphs import (
    GGML_TYPE_F32,
    Graph,
    binary_symbols,
    cpu_module,
    ggml,
    require_avx2,
)

GGML_TYPE_Q6_K = 14
QK_K = 256
Q6_K_BLOCK = np.dtype(
    [("ql", "u1", (128,)), ("qh", "u1", (64,)), ("sc", "i1", (16,)), ("d", "<f2")]
)
Q8_K_BLOCK = np.dtype([("d", "<f4"), ("qs", "i1", (QK_K,)), ("bsums", "<i2", (16,))])
# 8 Q4_K blocks interleaved by ggml's repacking (block_q4_Kx8): scales and mins of all 8, then
# their packed 6-bit sub-block scales and their nibbles.
Q4_KX8_BLOCK = np.dtype(
    [("d", "<f2", (8,)), ("dmin", "<f2", (8,)), ("scales", "u1", (96,)), ("qs", "u1", (1024,))]
)
assert (Q6_K_BLOCK.itemsize, Q8_K_BLOCK.itemsize, Q4_KX8_BLOCK.itemsize) == (210, 292, 1152)
EPS32 = 2.0**-23
P, SZ, I32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int


@pytest.fixture(scope="module", autouse=True)
def avx2() -> None:
    require_avx2()


def kernel(name: str, *argtypes: object) -> Any:
    fn = getattr(ctypes.CDLL(str(cpu_module())), name)  # the module ggml loaded: same handle
    fn.restype, fn.argtypes = None, list(argtypes)
    return fn


def random_q6_k(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    blocks = np.zeros(rows * (k // QK_K), dtype=Q6_K_BLOCK)
    blocks["ql"] = rng.integers(0, 256, blocks["ql"].shape, dtype=np.uint8)
    blocks["qh"] = rng.integers(0, 256, blocks["qh"].shape, dtype=np.uint8)
    blocks["sc"] = rng.integers(-128, 128, blocks["sc"].shape, dtype=np.int8)
    blocks["d"] = rng.uniform(0.0005, 0.005, blocks.shape)
    return blocks.view(np.uint8).reshape(rows, -1)


def q6_k_values(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(d [rows, nb], sc * q [rows, nb, 256]) of Q6_K rows, read as ggml-common.h lays them
    out: element e of a block is 6 bits (4 in ql, 2 in qh) minus 32, scaled by sc[e // 16]."""
    b = np.ascontiguousarray(raw).view(Q6_K_BLOCK).reshape(raw.shape[0], k // QK_K)
    ql, qh = b["ql"].astype(np.int64), b["qh"].astype(np.int64)
    q = np.empty((*b.shape, QK_K), dtype=np.int64)
    for h in range(2):
        lo, hi = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
        base = 128 * h
        q[..., base : base + 32] = (lo[..., :32] & 0xF) | ((hi & 3) << 4)
        q[..., base + 32 : base + 64] = (lo[..., 32:] & 0xF) | (((hi >> 2) & 3) << 4)
        q[..., base + 64 : base + 96] = (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4)
        q[..., base + 96 : base + 128] = (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)
    scale = np.repeat(b["sc"].astype(np.int64), 16, axis=-1)
    return b["d"].astype(np.float64), scale * (q - 32)


def exact_activations(rng: np.random.Generator, columns: int, k: int) -> np.ndarray:
    """Whole numbers in [-126, 126] with one -127 per 256-block: Q8_K holds them exactly."""
    x = rng.integers(-126, 127, (columns, k // QK_K, QK_K))
    x[np.arange(columns)[:, None], np.arange(k // QK_K)[None, :], rng.integers(0, QK_K)] = -127
    return x.reshape(columns, k).astype(np.float32)


def q8_k_bytes(x: np.ndarray) -> np.ndarray:
    """exact_activations as ggml's Q8_K blocks (scale 1), rows of bytes."""
    blocks = np.zeros((x.shape[0], x.shape[1] // QK_K), dtype=Q8_K_BLOCK)
    q = x.reshape(x.shape[0], -1, QK_K).astype(np.int64)
    blocks["d"], blocks["qs"] = 1.0, q
    blocks["bsums"] = q.reshape(*q.shape[:2], 16, 16).sum(axis=-1)
    return blocks.view(np.uint8).reshape(x.shape[0], -1)


def q6_k_reference(w_raw: np.ndarray, k: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out [columns, rows], tolerance) of W x for exact_activations x, in float64."""
    d, v = q6_k_values(w_raw, k)
    xq = x.reshape(x.shape[0], -1, QK_K).astype(np.int64)
    dots = np.einsum("rbe,cbe->crb", v, xq)  # exact integers
    abs_dots = np.einsum("rbe,cbe->crb", np.abs(v), np.abs(xq))
    out = (d[None] * dots).sum(axis=-1)
    abs_sum = (d[None] * abs_dots).sum(axis=-1)
    return out, (k // QK_K + 10) * EPS32 * abs_sum


def graph_product(w_raw: np.ndarray, rows: int, k: int, x: np.ndarray, threads: int) -> np.ndarray:
    with Graph(w_raw.nbytes + x.nbytes * 3 + rows * x.shape[0] * 4) as graph:
        w = graph.tensor(GGML_TYPE_Q6_K, [k, rows], w_raw)
        xt = graph.tensor(GGML_TYPE_F32, [k, x.shape[0]], x)
        out = int(graph.g.base.ggml_mul_mat(graph.ctx, w, xt))
        assert graph.type_name(w) == "q6_K"
        assert graph.head(w).buffer is None  # no repacking: ggml's vec-dot path
        return graph.compute(out, threads).reshape(x.shape[0], rows)


def test_the_loaded_cpu_module_carries_the_k_quant_kernels() -> None:
    symbols = binary_symbols(cpu_module())
    missing = {"ggml_gemv_q4_K_8x8_q8_K_cols", "ggml_vec_dot_q6_K_q8_K_cols"} - symbols
    assert not missing, f"{cpu_module().name} lacks {missing}: not the patched build"
    assert "ggml-cpu-q4_K_M-cols" in ggml().backend.patches


def test_q6_k_columns_called_directly_equal_ggml_one_column_at_a_time() -> None:
    """Every width 1..8, columns a spare block of noise apart and results 3 floats apart:
    bit-identical to ggml_vec_dot_q6_K_q8_K on each column, and within the numpy tolerance."""
    cols = kernel("ggml_vec_dot_q6_K_q8_K_cols", I32, P, SZ, P, P, SZ, I32)
    one = kernel("ggml_vec_dot_q6_K_q8_K", I32, P, SZ, P, SZ, P, SZ, I32)
    rng = np.random.default_rng(11)
    k = 3 * QK_K
    w_raw = random_q6_k(rng, 1, k)
    x = exact_activations(rng, 8, k)
    noise = rng.integers(0, 256, (8, Q8_K_BLOCK.itemsize), dtype=np.uint8)
    x_spaced = np.ascontiguousarray(np.hstack([q8_k_bytes(x), noise]))
    by = x_spaced.shape[1]
    ref, tol = q6_k_reference(w_raw, k, x)
    for nc in range(1, 9):
        out = np.full((nc, 3), np.nan, dtype=np.float32)
        cols(k, out.ctypes.data, 3, w_raw.ctypes.data, x_spaced.ctypes.data, by, nc)
        assert np.isnan(out[:, 1:]).all(), f"{nc} columns: wrote between the results"
        single = np.empty(nc, dtype=np.float32)
        for c in range(nc):
            one(k, single[c:].ctypes.data, 0, w_raw.ctypes.data, 0,
                x_spaced.ctypes.data + c * by, 0, 1)  # fmt: skip
        assert np.array_equal(out[:, 0], single), (nc, out[:, 0], single)
        assert (np.abs(out[:, 0] - ref[:nc, 0]) <= tol[:nc, 0]).all(), (nc, out[:, 0], ref[:nc])


@pytest.mark.parametrize("threads", [1, 2])
def test_q6_k_products_match_numpy_and_one_column_at_a_time(threads: int) -> None:
    """ggml's Q6_K x f32 product for 1..9 columns and ragged row counts, within the numpy
    tolerance. Up to 7 columns it is the patched branch where q6_K_cols is on (from 8, ggml's
    tiled K-quant path takes the whole product), and bit-identical to the same columns
    multiplied one at a time (ggml's own kernel: a lone column never takes the batched one)."""
    rng = np.random.default_rng(20 + threads)
    k = 2 * QK_K
    print(f"kernel paths on: {ggml().backend.kernel_paths}")
    for rows in (1, 3, 16, 21):
        w_raw = random_q6_k(rng, rows, k)
        for columns in range(1, 10):
            x = exact_activations(rng, columns, k)
            got = graph_product(w_raw, rows, k, x, threads)
            ref, tol = q6_k_reference(w_raw, k, x)
            assert (np.abs(got - ref) <= tol).all(), (rows, columns)
            if columns >= 8:
                continue
            alone = np.concatenate(
                [graph_product(w_raw, rows, k, x[c : c + 1], threads) for c in range(columns)]
            )
            assert np.array_equal(got, alone), (rows, columns)


def test_the_q6_k_tolerance_rejects_a_wrong_product() -> None:
    rng = np.random.default_rng(5)
    k, rows = QK_K, 4
    w_raw = random_q6_k(rng, rows, k)
    x = exact_activations(rng, 5, k)
    got = graph_product(w_raw, rows, k, x, 1).astype(np.float64)
    ref, tol = q6_k_reference(w_raw, k, x)
    assert (np.abs(got - ref) <= tol).all()
    for wrong in (np.roll(ref, 1, axis=0), np.roll(ref, 1, axis=1), ref * (1 + 1e-3)):
        assert (np.abs(got - wrong) / tol).max() > 10


def random_q4_kx8(rng: np.random.Generator, groups: int, nb: int) -> np.ndarray:
    blocks = np.zeros(groups * nb, dtype=Q4_KX8_BLOCK)
    blocks["d"] = rng.uniform(0.0005, 0.005, blocks["d"].shape)
    blocks["dmin"] = rng.uniform(0.0005, 0.005, blocks["dmin"].shape)
    blocks["scales"] = rng.integers(0, 256, blocks["scales"].shape, dtype=np.uint8)
    blocks["qs"] = rng.integers(0, 256, blocks["qs"].shape, dtype=np.uint8)
    return blocks.view(np.uint8)


def test_repacked_q4_k_rows_called_directly_equal_ggml_one_row_at_a_time() -> None:
    """ggml_gemv_q4_K_8x8_q8_K_cols for 1..3 token rows (a spare block of noise between them,
    results 40 floats apart) against ggml_gemv_q4_K_8x8_q8_K run on each row alone."""
    cols = kernel("ggml_gemv_q4_K_8x8_q8_K_cols", I32, P, SZ, P, P, SZ, I32, I32)
    gemv = kernel("ggml_gemv_q4_K_8x8_q8_K", I32, P, SZ, P, P, I32, I32)
    rng = np.random.default_rng(7)
    k, nc = 6 * QK_K, 24  # 3 groups of 8 weight rows
    w = random_q4_kx8(rng, nc // 8, k // QK_K)
    x = exact_activations(rng, 3, k)
    noise = rng.integers(0, 256, (3, Q8_K_BLOCK.itemsize), dtype=np.uint8)
    x_spaced = np.ascontiguousarray(np.hstack([q8_k_bytes(x), noise]))
    by = x_spaced.shape[1]
    for nr in range(1, 4):
        out = np.full((nr, 40), np.nan, dtype=np.float32)
        cols(k, out.ctypes.data, 40, w.ctypes.data, x_spaced.ctypes.data, by, nr, nc)
        assert np.isnan(out[:, nc:]).all(), f"{nr} rows: wrote past a row's results"
        single = np.empty((nr, nc), dtype=np.float32)
        for r in range(nr):
            gemv(k, single[r].ctypes.data, 0, w.ctypes.data, x_spaced.ctypes.data + r * by, 1, nc)
        assert np.isfinite(single).all()
        assert np.array_equal(out[:, :nc], single), nr
    # The rows differ, so a kernel that used one row's activations for all would fail.
    assert not np.array_equal(single[0], single[1])


MODEL = "smollm2-135m-instruct-q4_k_m"


@pytest.fixture(scope="module")
def runtime() -> Iterator[LlamaRuntime]:
    rt = LlamaRuntime(
        RuntimeConfig(real_model_path(MODEL), n_ctx=1024, n_batch=256, n_seq_max=3, flash_attn="on")
    )
    try:
        yield rt
    finally:
        rt.close()


def decode_steps(rt: LlamaRuntime, sessions: int, together: bool) -> np.ndarray:
    """Prompts one session at a time, then 3 decode steps of every session: in one batch
    (together) or one token per llama_decode. Returns the decode steps' logits."""
    rt.clear_memory()
    batch: Batch = rt.new_batch()
    lens = [[7, 4, 9][s % 3] + s // 3 for s in range(sessions)]
    try:
        for s, n in enumerate(lens):
            batch.clear()
            batch.add_span([60 + 5 * s + 11 * p for p in range(n)], 0, s, logits_last=True)
            assert rt.decode(batch) == 0
        out = []
        for step in range(3):
            rows = []
            for group in [range(sessions)] if together else [[s] for s in range(sessions)]:
                batch.clear()
                for s in group:
                    batch.add(200 + 31 * s + 7 * step, lens[s] + step, s, True)
                assert rt.decode(batch) == 0
                rows += [rt.logits(i).copy() for i in range(len(group))]
            out.append(np.stack(rows))
        return np.stack(out)
    finally:
        batch.free()


@pytest.mark.real_model
@pytest.mark.parametrize("sessions", [2, 3])
def test_a_q4_k_m_decode_step_equals_one_token_steps(runtime: LlamaRuntime, sessions: int) -> None:
    """SmolLM2 Q4_K_M (its FFN down projections Q4_K, repacked, and Q6_K): 2 or 3 sessions
    in one step take both batched kernels where the paths are on; their logits must equal
    the same tokens decoded one at a time, which run ggml's one-token kernels."""
    assert "CPU_REPACK" in runtime.backend.extra_buffer_types
    print(f"kernel paths on: {runtime.backend.kernel_paths}")
    together = decode_steps(runtime, sessions, together=True)
    alone = decode_steps(runtime, sessions, together=False)
    assert np.isfinite(together).all()
    assert np.array_equal(together, alone), float(np.abs(together - alone).max())
    assert not np.array_equal(together[:, 0], together[:, 1])


@pytest.mark.real_model
def test_the_model_file_has_q4_k_and_q6_k_weights() -> None:
    from gguf import GGUFReader

    types = {t.tensor_type.name for t in GGUFReader(real_model_path(MODEL)).tensors}
    assert {"Q4_K", "Q6_K"} <= types, types
