"""The 512-bit Q8_0 and Q5_0 kernels against llamafile's tinyBLAS, one matrix product at a time.

Two processes load the engine's wheel: one with the kernel paths ``q5_0_cols`` and
``q8_0_cols`` on (``POLYKV_GGML_PATHS``), one with every path off, where ggml's
``llamafile_sgemm`` runs tinyBLAS_Q0_AVX as upstream does. Each times ``llamafile_sgemm``
itself (one thread, called through ctypes: what ggml calls for a product of these types) on
the shapes of SmolLM2 Q4_K_M's Q5_0 projections and of its Q8_0 output matrix, with seeded
random blocks that both processes build alike, at token counts from a decode step to a
prompt chunk. The processes take turns per repetition; ratios are paired per repetition,
and the outputs are compared bit for bit. The decode table of ``bench/kernel_paths.py`` is
what the kernels give a server; this shows where in the token counts they win.

    python -m bench.q0_kernels [--reps 5]
    python -m bench.q0_kernels --from-json bench/results/q0_kernels.json
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import harness as H
from . import report as R

NAME = "q0_kernels"
PATHS_ENV = "POLYKV_GGML_PATHS"
SIDES = {"zmm": "q5_0_cols,q8_0_cols", "tinyblas": "none"}
QK = 32
GGML_TYPE_F32, GGML_TYPE_Q5_0, GGML_TYPE_Q8_0 = 0, 6, 8
BLOCK_BYTES = {GGML_TYPE_Q5_0: 22, GGML_TYPE_Q8_0: 34}
# (label, weight type, rows, k): SmolLM2 Q4_K_M's shapes.
SHAPES = (
    ("Q5_0 576 → 576 (attention q, o)", GGML_TYPE_Q5_0, 576, 576),
    ("Q5_0 576 → 1536 (FFN gate, up)", GGML_TYPE_Q5_0, 1536, 576),
    ("Q8_0 576 → 49152 (output)", GGML_TYPE_Q8_0, 49152, 576),
)


@dataclass
class Config:
    reps: int = 5
    tokens: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128)
    min_time_s: float = 0.05  # per timed point per repetition


class ComputeParams(ctypes.Structure):
    """ggml-cpu-impl.h's struct ggml_compute_params (the fields tinyBLAS reads: ith, nth)."""

    _fields_ = [
        ("ith", ctypes.c_int),
        ("nth", ctypes.c_int),
        ("wsize", ctypes.c_size_t),
        ("wdata", ctypes.c_void_p),
        ("threadpool", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


def sgemm_function(library: str) -> Any:
    """``llamafile_sgemm`` of a loaded ggml CPU module, declared for ctypes: (params, m, n, k,
    A, lda, B, ldb, C, ldc, A type, B type, C type), sizes in blocks, True when it computed."""
    fn = ctypes.CDLL(library).llamafile_sgemm
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.restype = ctypes.c_bool
    fn.argtypes = [ctypes.POINTER(ComputeParams), i64, i64, i64, p, i64, p, i64, p, i64]
    fn.argtypes += [i32, i32, i32]
    return fn


_sgemm: Any = None
_paths: tuple[str, ...] = ()


def _start(paths: str) -> None:
    """Child initializer: choose the paths, load the CPU module the engine would."""
    global _sgemm, _paths
    os.environ[PATHS_ENV] = paths
    from polykv_engine.llama.runtime import init_backend

    info = init_backend()
    assert info.cpu_library, "no per-CPU ggml module is loaded"
    _sgemm, _paths = sgemm_function(info.cpu_library), tuple(info.kernel_paths)


def _blocks(w_type: int, rows: int, k: int, seed: int) -> np.ndarray:
    """Seeded random weight blocks of w_type: a positive fp16 scale, quants of any value."""
    rng = np.random.default_rng(seed)
    nbytes = BLOCK_BYTES[w_type]
    raw = rng.integers(0, 256, (rows * (k // QK), nbytes), dtype=np.uint8)
    raw[:, :2] = np.frombuffer(
        rng.uniform(0.001, 0.01, rows * (k // QK)).astype("<f2").tobytes(), np.uint8
    ).reshape(-1, 2)
    if w_type == GGML_TYPE_Q8_0:
        raw[:, 2:][raw[:, 2:] == 128] = 129  # ggml's quantizer never writes -128
    return raw


def _activations(n: int, k: int, seed: int) -> np.ndarray:
    """n Q8_0 activation rows: scale as ggml's quantizer sets it, quants in -127..127."""
    rng = np.random.default_rng(seed)
    raw = np.zeros((n * (k // QK), 34), dtype=np.uint8)
    raw[:, :2] = np.frombuffer(
        rng.uniform(0.01, 0.05, n * (k // QK)).astype("<f2").tobytes(), np.uint8
    ).reshape(-1, 2)
    raw[:, 2:] = rng.integers(-127, 128, (n * (k // QK), 32), dtype=np.int8).view(np.uint8)
    return raw


def time_point(w_type: int, rows: int, k: int, n: int, min_time_s: float) -> dict[str, Any]:
    """In the child: the mean time of one llamafile_sgemm call, and a hash of its output."""
    w = _blocks(w_type, rows, k, seed=rows + k + w_type)
    x = _activations(n, k, seed=n)
    out = np.zeros((n, rows), dtype=np.float32)
    params = ComputeParams(0, 1, 0, None, None, False)

    def call() -> None:
        ok = _sgemm(
            ctypes.byref(params),
            rows,
            n,
            k // QK,
            w.ctypes.data,
            k // QK,
            x.ctypes.data,
            k // QK,
            out.ctypes.data,
            rows,
            w_type,
            GGML_TYPE_Q8_0,
            GGML_TYPE_F32,
        )
        assert ok, "llamafile_sgemm declined the product"

    call()
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_time_s or calls < 3:
        call()
        calls += 1
    return {
        "us": elapsed / calls * 1e6,
        "calls": calls,
        "out_sha1": hashlib.sha1(out.tobytes()).hexdigest(),
        "paths": list(_paths),
    }


def measure(cfg: Config) -> dict[str, Any]:
    raw: dict[str, Any] = {"env": R.environment(), "runs": []}
    ctx = multiprocessing.get_context("spawn")
    pools = {
        side: ProcessPoolExecutor(1, mp_context=ctx, initializer=_start, initargs=(paths,))
        for side, paths in SIDES.items()
    }
    try:
        for rep in range(cfg.reps):
            order = list(SIDES) if rep % 2 == 0 else list(reversed(SIDES))
            for label, w_type, rows, k in SHAPES:
                for n in cfg.tokens:
                    for side in order:
                        point = pools[side].submit(time_point, w_type, rows, k, n, cfg.min_time_s)
                        run = point.result(timeout=600)
                        raw["runs"].append(
                            {"rep": rep, "shape": label, "tokens": n, "side": side, **run}
                        )
                H.progress(f"rep {rep + 1}/{cfg.reps} {label} done")
    finally:
        for pool in pools.values():
            pool.shutdown()
    raw["paths"] = {
        side: next(r["paths"] for r in raw["runs"] if r["side"] == side) for side in SIDES
    }
    return raw


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, *_ in SHAPES:
        for n in cfg.tokens:
            runs = [r for r in raw["runs"] if r["shape"] == label and r["tokens"] == n]
            by_rep: dict[int, dict[str, dict[str, Any]]] = {}
            for r in runs:
                by_rep.setdefault(r["rep"], {})[r["side"]] = r
            pairs = [v for v in by_rep.values() if len(v) == 2]
            if not pairs:
                continue
            out[f"{label}|{n}"] = {
                "zmm_us": H.summarize([p["zmm"]["us"] for p in pairs]).as_dict(),
                "tinyblas_us": H.summarize([p["tinyblas"]["us"] for p in pairs]).as_dict(),
                "speedup": H.summarize(
                    [p["tinyblas"]["us"] / p["zmm"]["us"] for p in pairs]
                ).as_dict(),
                "same_bits": sum(p["zmm"]["out_sha1"] == p["tinyblas"]["out_sha1"] for p in pairs),
                "pairs": len(pairs),
            }
    return out


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    head = ["shape", "tokens", "tinyBLAS µs", "512-bit µs", "tinyBLAS ÷ 512-bit", "same bits"]
    rows = []
    for key, r in res.items():
        label, n = key.split("|")
        rows.append(
            [
                label,
                n,
                R.fmt(r["tinyblas_us"], 0),
                R.fmt(r["zmm_us"], 0),
                R.fmt(r["speedup"], 2, 1, "×"),
                f"{r['same_bits']}/{r['pairs']}",
            ]
        )
    paths = raw["paths"]
    return "\n".join(
        [
            "### The 512-bit Q8_0 and Q5_0 kernels against tinyBLAS, one product at a time",
            "",
            R.markdown_table(head, rows),
            "",
            "`llamafile_sgemm` (the function ggml calls for a product of these types) timed "
            "through ctypes on one thread, in two processes on the engine's wheel "
            f"(llama-cpp-python {env['llama_cpp_python']}): *512-bit* with the kernel paths "
            f"{', '.join(paths['zmm']) or 'none'} (ggml-cpu-zmm-q0-cols), *tinyBLAS* with "
            f"every path off ({', '.join(paths['tinyblas']) or 'none'} on), llamafile's "
            "tinyBLAS_Q0_AVX as upstream runs it. Seeded random weight blocks of SmolLM2 "
            "Q4_K_M's shapes, the same in both processes; mean time per call over at least "
            f"{cfg.min_time_s * 1000:.0f} ms; median (min–max) of {cfg.reps} repetitions, the "
            "processes taking turns, ratios paired per repetition. *Same bits*: repetitions "
            "whose outputs hashed the same. Above 64 tokens the patch hands the product to "
            "tinyBLAS, so that row compares tinyBLAS with itself.",
            "",
            R.provenance(NAME, env),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--tokens", default=",".join(str(n) for n in Config.tokens))
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render)) is not None:
        return rc
    cfg = Config(args.reps, tuple(int(n) for n in args.tokens.split(",")))
    if args.quick:
        cfg.reps, cfg.tokens, cfg.min_time_s = 1, (2, 8), 0.01
    if cfg.reps < 1 or not cfg.tokens or min(cfg.tokens) < 2:
        p.error("--reps >= 1, --tokens >= 2 each")
    return R.run_and_publish(NAME, cfg, args, measure, analyse, render)


if __name__ == "__main__":
    raise SystemExit(main())
