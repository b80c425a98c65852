"""``llama_decode`` alone, through the ctypes API, with no server around it.

The reference a serving benchmark compares against: k sequences of one token each per
``llama_decode`` in a context configured like the engine's (unified KV, same n_ctx,
n_batch, n_seq_max, threads and flash-attention setting). Its time per call is what the
engine's step could at best cost, and k x (one-token call) / (k-token call) is the best
aggregate-tps scaling batching can give on this machine.

Runs in a child process (``python -m bench.direct_decode ...``, JSON on stdout) so that
libllama and its OpenMP threads never live in the benchmark client's process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polykv_engine.llama.omp import apply_omp_policy

from . import harness as H
from .model_file import quiet_llama_logs


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    # Before libllama (and OpenMP) loads: as the engine does.
    apply_omp_policy(os.environ, threads=args.threads)
    import llama_cpp.llama_cpp as C

    from polykv_engine.llama.runtime import init_backend

    init_backend()  # the per-CPU backend modules of the portable wheel, as the engine loads them
    quiet_llama_logs()
    model = C.llama_model_load_from_file(str(args.model).encode(), C.llama_model_default_params())
    if not model:
        raise H.BenchError(f"cannot load {args.model}")
    cp = C.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = args.ctx, 2048, 512
    cp.n_seq_max = args.n_seq_max
    cp.n_threads = cp.n_threads_batch = args.threads
    cp.kv_unified = True
    cp.flash_attn_type = (
        C.LLAMA_FLASH_ATTN_TYPE_ENABLED if args.fa == "on" else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    ctx = C.llama_init_from_model(model, cp)
    if not ctx:
        raise H.BenchError("cannot create a llama context")
    mem = C.llama_get_memory(ctx)
    n_vocab = int(C.llama_vocab_n_tokens(C.llama_model_get_vocab(model)))
    batch = C.llama_batch_init(2048, 0, 1)

    def put(i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i] = token % n_vocab
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if logits else 0

    def decode(n: int) -> float:
        batch.n_tokens = n
        t = time.perf_counter()
        rc = C.llama_decode(ctx, batch)
        dt = time.perf_counter() - t
        if rc != 0:
            raise H.BenchError(f"llama_decode returned {rc}")
        return dt

    out: dict[str, Any] = {}
    try:
        for k in args.levels:
            C.llama_memory_clear(mem, True)
            n = 0
            for s in range(k):
                for p in range(args.prompt):
                    put(n, 100 + 7 * s + 13 * p, p, s, p == args.prompt - 1)
                    n += 1
            decode(n)
            times = []
            for step in range(args.warm + args.steps):
                for s in range(k):
                    put(s, 200 + 11 * s + step, args.prompt + step, s, True)
                dt = decode(k)
                if step >= args.warm:
                    times.append(dt)
            # mean: total time over the steps, as a server's rate over a stream counts it
            out[str(k)] = 1e3 * (statistics.mean if args.stat == "mean" else statistics.median)(
                times
            )
    finally:
        C.llama_batch_free(batch)
        C.llama_free(ctx)
        C.llama_model_free(model)
    return out


def direct_decode_ms(
    model: Path,
    levels: Sequence[int],
    threads: int,
    fa: str = "off",
    ctx: int = 4096,
    n_seq_max: int = 24,
    prompt: int = 40,
    steps: int = 24,
    stat: str = "median",
) -> dict[int, float]:
    """Median (or mean) ms per ``llama_decode`` of k one-token sequences, for each k (child
    process)."""
    argv = [
        *(sys.executable, "-m", "bench.direct_decode", str(model)),
        *("--levels", ",".join(map(str, levels)), "--threads", str(threads), "--fa", fa),
        *("--ctx", str(ctx), "--n-seq-max", str(n_seq_max), "--prompt", str(prompt)),
        *("--steps", str(steps), "--stat", stat),
    ]
    proc = subprocess.run(
        argv, cwd=H.REPO_ROOT, capture_output=True, text=True, env={**os.environ, **H.SERVER_ENV}
    )
    if proc.returncode != 0:
        raise H.BenchError(f"direct decode probe failed:\n{proc.stderr[-2000:]}")
    return {int(k): float(v) for k, v in json.loads(proc.stdout).items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.direct_decode", description=__doc__)
    p.add_argument("model", type=Path)
    p.add_argument("--levels", default="1,2,4,8")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--fa", choices=["on", "off"], default="off")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--n-seq-max", type=int, default=24)
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens per sequence")
    p.add_argument("--warm", type=int, default=4, help="untimed steps first")
    p.add_argument("--steps", type=int, default=24, help="timed steps per level")
    p.add_argument("--stat", choices=["median", "mean"], default="median", help="per step")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    print(json.dumps(_measure(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
