"""The 512-bit Q8_0 and Q5_0 kernels (scripts/patches/ggml-cpu-zmm-q0-cols.patch) against
llamafile's tinyBLAS, which they replace, and against numpy.

On x86 ggml sends a product of Q8_0 or Q5_0 weights with 2 or more tokens to llamafile's
tinyBLAS_Q0_AVX (no repacking covers these types there): one 256-bit accumulator of eight
float lanes per output, a fused multiply-add of scale times the int32 dot products per weight
block, and a final horizontal sum. In the zen4 variant the patch computes 2..64 tokens with
two weight rows side by side in each 512-bit register (paths q5_0_cols and q8_0_cols), keeping
every lane's operations and the final sum's order, so the outputs must be the same bits.

References that share none of the patch:

* tinyBLAS itself, in a process where every kernel path is off: each product below, and a
  real model's logits, must be equal bit for bit, at every width and row count, on 1 and 3
  threads, and called directly with strides that are not the packed ones;
* a numpy product over blocks read from their bytes as ggml-common.h lays them out (Q8_0: fp16
  d, 32 signed quants; Q5_0: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles, a quant being
  the 5-bit value minus 16), with activations quantized to Q8_0 as ggml's x86 code does it,
  under test_q4_1_kernel_reference.py's tolerance.

The products run in child processes that choose their paths (POLYKV_GGML_PATHS: ggml decides
once per process), so the kernel is tested on any CPU that loads zen4, whatever the gate picks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pytest

from bench.q0_kernels import ComputeParams, sgemm_function
from polykv_engine.llama.runtime import LlamaRuntime, RuntimeConfig
from tests.conftest import real_model_path
from tests.engine.real import test_q4_1_kernel_reference as q4_1_tests
from tests.engine.real.ggml_graphs import (
    GGML_TYPE_F32,
    cpu_module,
    ggml,
    loaded_paths,
    paths_process,
    require_avx2,
)
from tests.engine.real.test_k_quant_kernels import decode_steps
from tests.engine.real.test_q4_1_kernel_reference import (
    QK,
    Blocks,
    q8_1_blocks,
    reference_product,
    within,
)
from tests.engine.real.test_q5_1_kernels import five_bit_values

GGML_TYPE_Q5_0, GGML_TYPE_Q8_0 = 6, 8
ZMM_PATHS = "q5_0_cols,q8_0_cols"
Q5_0_BLOCK = np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", (QK // 2,))])
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])
# ggml's block_q5_0 and block_q8_0: no padding between the fields.
assert (Q5_0_BLOCK.itemsize, Q8_0_BLOCK.itemsize) == (22, 34)
# The kernel takes rows 8 at a time and tokens 8 at a time (a group of 1..4 tokens in one tile
# of 8 rows, 5..8 in two of 4); other row counts, 1 token and 65 or more stay on ggml's own
# kernels. These reach every group width, several groups, and both fallbacks.
ROW_COUNTS = [2, 4, 6, 8, 12, 16, 40, 192]
COLUMN_COUNTS = [*range(1, 10), 12, 16, 17, 33, 64, 65]
TIMEOUT = 600


# --- the blocks and their reference --------------------------------------------------------


def random_q8_0(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Q8_0 blocks as ggml's quantizer makes them: d > 0, quants in -127..127."""
    blocks = np.zeros(rows * (k // QK), dtype=Q8_0_BLOCK)
    blocks["d"] = rng.uniform(0.0005, 0.01, blocks.shape)
    blocks["qs"] = rng.integers(-127, 128, (*blocks.shape, QK), dtype=np.int8)
    return blocks.view(np.uint8)


def random_q5_0(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Q5_0 blocks: d > 0, any fifth bits and nibbles."""
    blocks = np.zeros(rows * (k // QK), dtype=Q5_0_BLOCK)
    blocks["d"] = rng.uniform(0.001, 0.015, blocks.shape)
    blocks["qh"] = rng.integers(0, 2**32, blocks.shape, dtype=np.uint64).astype(np.uint32)
    blocks["qs"] = rng.integers(0, 256, (*blocks.shape, QK // 2), dtype=np.uint8)
    return blocks.view(np.uint8)


def q8_0_blocks(raw: np.ndarray, k: int) -> Blocks:
    blocks = np.ascontiguousarray(raw).view(Q8_0_BLOCK).reshape(-1, k // QK)
    d = blocks["d"].astype(np.float64)
    return Blocks(d, np.zeros_like(d), blocks["qs"].astype(np.int64))


def q5_0_blocks(raw: np.ndarray, k: int) -> Blocks:
    """A quant is the block's 5-bit value minus 16."""
    blocks = np.ascontiguousarray(raw).view(Q5_0_BLOCK).reshape(-1, k // QK)
    d = blocks["d"].astype(np.float64)
    return Blocks(d, np.zeros_like(d), five_bit_values(blocks) - 16)


WEIGHTS: dict[int, tuple[Callable[..., np.ndarray], Callable[[np.ndarray, int], Blocks]]] = {
    GGML_TYPE_Q5_0: (random_q5_0, q5_0_blocks),
    GGML_TYPE_Q8_0: (random_q8_0, q8_0_blocks),
}
TYPE_IDS = {GGML_TYPE_Q5_0: "q5_0", GGML_TYPE_Q8_0: "q8_0"}


# --- the two processes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def zmm() -> ProcessPoolExecutor:
    """A process running the two 512-bit paths (and no other), on a CPU that loads zen4."""
    require_avx2()
    variant = ggml().backend.cpu_variant
    if variant != "zen4":
        pytest.skip(
            f"the 512-bit paths are compiled into the zen4 variant only; this CPU loads {variant}"
        )
    pool = paths_process(ZMM_PATHS)
    assert pool.submit(loaded_paths).result(timeout=TIMEOUT) == ("q5_0_cols", "q8_0_cols")
    return pool


@pytest.fixture(scope="module")
def tinyblas() -> ProcessPoolExecutor:
    pool = paths_process("none")
    assert pool.submit(loaded_paths).result(timeout=TIMEOUT) == ()
    return pool


def both(
    zmm: ProcessPoolExecutor, tinyblas: ProcessPoolExecutor, fn: Callable[..., Any], *args: Any
) -> tuple[Any, Any]:
    """fn(*args) computed by the 512-bit kernels and by tinyBLAS (at the same time)."""
    ours, theirs = zmm.submit(fn, *args), tinyblas.submit(fn, *args)
    return ours.result(timeout=TIMEOUT), theirs.result(timeout=TIMEOUT)


# --- the tests -------------------------------------------------------------------------------


def test_the_loaded_cpu_module_knows_the_paths() -> None:
    assert "ggml-cpu-zmm-q0-cols" in ggml().backend.patches
    known = ctypes.CDLL(str(cpu_module())).polykv_ggml_paths_known
    known.restype, known.argtypes = ctypes.c_char_p, []
    assert {"q5_0_cols", "q8_0_cols"} <= set(known().decode().split(","))


def test_the_reference_unpacks_q5_0_quants() -> None:
    """One hand-made block: quants -16..15 in order need every qh bit where they are >= 0."""
    block = np.zeros(1, dtype=Q5_0_BLOCK)
    block["d"] = 0.5
    want = np.arange(QK) - 16
    v = want + 16
    block["qs"] = (v[:16] & 0x0F) | (v[16:] & 0x0F) << 4
    block["qh"] = sum(1 << j for j in range(QK) if v[j] >= 16)
    got = q5_0_blocks(block.view(np.uint8), QK)
    assert got.q[0, 0].tolist() == want.tolist()
    assert got.d.item() == 0.5


def shapes_products(w_type: int, k: int, n_threads: int, seed: int) -> list[np.ndarray]:
    """ggml's product for every row count and width, from seeded random blocks; runs in the
    process it is submitted to."""
    make, _ = WEIGHTS[w_type]
    rng = np.random.default_rng(seed)
    out = []
    for rows in ROW_COUNTS:
        w_raw = make(rng, rows, k)
        for columns in COLUMN_COUNTS:
            x = rng.standard_normal((columns, k)).astype(np.float32)
            out.append(q4_1_tests.ggml_product(w_raw, rows, k, x, n_threads, w_type))
    return out


@pytest.mark.parametrize("n_threads", [1, 3])
@pytest.mark.parametrize("k", [32, 576])
@pytest.mark.parametrize("w_type", list(WEIGHTS), ids=TYPE_IDS.get)
def test_products_equal_tinyblas_bit_for_bit(
    zmm: ProcessPoolExecutor, tinyblas: ProcessPoolExecutor, w_type: int, k: int, n_threads: int
) -> None:
    seed = 10 * k + n_threads + w_type
    ours, theirs = both(zmm, tinyblas, shapes_products, w_type, k, n_threads, seed)
    shapes = [(r, c) for r in ROW_COUNTS for c in COLUMN_COUNTS]
    for (rows, columns), a, b in zip(shapes, ours, theirs, strict=True):
        assert a.shape == (columns, rows)
        assert np.array_equal(a, b), (rows, columns, float(np.abs(a - b).max()))
    # The same inputs against numpy, here: the product is right, not only equal.
    make, unpack = WEIGHTS[w_type]
    rng = np.random.default_rng(seed)
    worst = 0.0
    for (rows, columns), got in zip(shapes, ours, strict=True):
        if columns == 1:
            w_raw = make(rng, rows, k)
        x = rng.standard_normal((columns, k)).astype(np.float32)
        ref = reference_product(unpack(w_raw, k), q8_1_blocks(x))
        worst = max(worst, within(got, ref, f"{rows} rows x {columns} columns"))
    print(f"{TYPE_IDS[w_type]}, k={k}, {n_threads} threads: worst {worst:.3f} of the tolerance")


def sgemm_spaced(
    w_type: int, w_spaced: np.ndarray, x_spaced: np.ndarray, k: int, nth: int
) -> np.ndarray:
    """llamafile_sgemm (the function ggml calls, exported by the CPU module) on weight rows
    and activation columns each followed by a block of noise, writing results 3 rows apart
    into NaN; every one of nth threads' shares called in turn. Returns the raw output."""
    fn = sgemm_function(str(cpu_module()))
    rows, columns = w_spaced.shape[0], x_spaced.shape[0]
    ldc = rows + 3
    out = np.full((columns, ldc), np.nan, dtype=np.float32)
    for ith in range(nth):
        params = ComputeParams(ith, nth, 0, None, None, False)
        done = fn(
            ctypes.byref(params),
            rows,
            columns,
            k // QK,
            w_spaced.ctypes.data,
            k // QK + 1,
            x_spaced.ctypes.data,
            k // QK + 1,
            out.ctypes.data,
            ldc,
            w_type,
            GGML_TYPE_Q8_0,
            GGML_TYPE_F32,
        )
        assert done, "llamafile_sgemm declined the product"
    return out


@pytest.mark.parametrize("w_type", list(WEIGHTS), ids=TYPE_IDS.get)
def test_direct_calls_with_spaced_strides_equal_tinyblas(
    zmm: ProcessPoolExecutor, tinyblas: ProcessPoolExecutor, w_type: int
) -> None:
    """A kernel that ignored a stride would read the noise blocks or write into the NaN gap;
    3 threads' shares of 5 tiles are uneven."""
    make, unpack = WEIGHTS[w_type]
    rng = np.random.default_rng(8)
    rows, k = 40, 160
    block = Q5_0_BLOCK if w_type == GGML_TYPE_Q5_0 else Q8_0_BLOCK
    w_raw = make(rng, rows, k).reshape(rows, -1)
    noise_w = make(rng, rows, QK).reshape(rows, -1)  # well-formed blocks: no NaN scales
    w_spaced = np.ascontiguousarray(np.hstack([w_raw, noise_w]))
    assert w_spaced.shape[1] == (k // QK + 1) * block.itemsize
    for columns in [*range(2, 10), 17, 64]:
        x = rng.standard_normal((columns + 1, k + QK)).astype(np.float32)
        xq = q8_1_blocks(x)  # quantized as Q8_0 (Q8_1's s is not stored)
        x_blocks = np.zeros(xq.d.shape, dtype=Q8_0_BLOCK)
        x_blocks["d"], x_blocks["qs"] = xq.d, xq.q
        x_spaced = np.ascontiguousarray(x_blocks.view(np.uint8).reshape(columns + 1, -1)[:columns])
        ours, theirs = both(zmm, tinyblas, sgemm_spaced, w_type, w_spaced, x_spaced, k, 3)
        assert np.isnan(ours[:, rows:]).all(), f"{columns} columns: wrote into the gap"
        assert np.array_equal(ours, theirs, equal_nan=True), columns
        x_part = Blocks(xq.d[:columns, :-1], xq.extra[:columns, :-1], xq.q[:columns, :-1])
        within(ours[:, :rows], reference_product(unpack(w_raw, k), x_part), f"{columns} columns")


def test_an_activation_of_minus_128_tells_the_kernels_apart(
    zmm: ProcessPoolExecutor, tinyblas: ProcessPoolExecutor
) -> None:
    """The two kernels agree on every activation ggml's quantizer writes (-127..127); on -128
    they part, which shows that the 512-bit kernel is the one that ran. tinyBLAS multiplies
    |w| by the activation with w's sign (a byte-sign instruction), and -(-128) does not fit
    in a byte; the 512-bit kernel's integers are exact."""
    rows, k = 8, QK
    w = np.zeros((rows, 2), dtype=Q8_0_BLOCK)  # each row one block and a spare
    w["d"], w["qs"] = 1.0, -1
    x = np.zeros((2, 2), dtype=Q8_0_BLOCK)  # two tokens
    x["d"], x["qs"] = 1.0, -128
    w_raw, x_raw = (np.ascontiguousarray(a.view(np.uint8).reshape(a.shape[0], -1)) for a in (w, x))
    ours, theirs = both(zmm, tinyblas, sgemm_spaced, GGML_TYPE_Q8_0, w_raw, x_raw, k, 1)
    assert (ours[:, :rows] == QK * 128).all(), ours[:, :rows]
    assert (theirs[:, :rows] == -QK * 128).all(), theirs[:, :rows]


def _fifth_bit_lost(w: Blocks, x: Blocks) -> np.ndarray:
    return reference_product(Blocks(w.d, w.extra, ((w.q + 16) & 0x0F) - 16), x).out


def _sign_lost(w: Blocks, x: Blocks) -> np.ndarray:
    return reference_product(Blocks(w.d, w.extra, np.abs(w.q)), x).out


# Q8_0 and Q5_0 have no min term to drop.
BROKEN = [
    *(b for b in q4_1_tests.BROKEN if b.name != "min term dropped"),
    q4_1_tests.Broken("fifth bit lost", _fifth_bit_lost),
    q4_1_tests.Broken("sign lost", _sign_lost),
]


@pytest.mark.parametrize("broken", BROKEN, ids=[b.name for b in BROKEN])
def test_the_tolerance_rejects_a_wrong_product(
    zmm: ProcessPoolExecutor, broken: q4_1_tests.Broken
) -> None:
    """On the 512-bit kernel's own Q5_0 output (8 rows, 8 columns), the right reference is
    within the tolerance and each wrong one far outside it."""
    rng = np.random.default_rng(4)
    rows, k = 8, 96
    w_raw = random_q5_0(rng, rows, k)
    x = rng.standard_normal((8, k)).astype(np.float32)
    got = zmm.submit(q4_1_tests.ggml_product, w_raw, rows, k, x, 1, GGML_TYPE_Q5_0).result(
        timeout=TIMEOUT
    )
    q4_1_tests.assert_rejects(got, q5_0_blocks(w_raw, k), q8_1_blocks(x), broken)


# --- a real model ------------------------------------------------------------------------------

SESSIONS = 8


def decode_logits(model: str) -> np.ndarray:
    """SESSIONS prompts, then 3 decode steps of all the sessions in one batch: the decode
    steps' logits. Runs in the process it is submitted to."""
    config = RuntimeConfig(
        real_model_path(model), n_ctx=1024, n_batch=256, n_seq_max=SESSIONS, flash_attn="on"
    )
    rt = LlamaRuntime(config)
    try:
        return decode_steps(rt, SESSIONS, together=True)
    finally:
        rt.close()


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2-135m-instruct-q4_k_m", "smollm2-135m-instruct-q8_0"])
def test_a_model_decodes_the_same_logits_on_either_kernel(
    zmm: ProcessPoolExecutor, tinyblas: ProcessPoolExecutor, model: str
) -> None:
    """SmolLM2 Q4_K_M (most of its bytes Q5_0 and Q8_0: 576 columns do not fill a K-quant
    block) and SmolLM2 Q8_0, 8 sessions per decode step: the same logits, bit for bit."""
    ours, theirs = both(zmm, tinyblas, decode_logits, model)
    assert np.isfinite(ours).all()
    assert np.array_equal(ours, theirs), float(np.abs(ours - theirs).max())
    assert not np.array_equal(ours[:, 0], ours[:, 1])
