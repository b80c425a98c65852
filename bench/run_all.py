"""``make bench``: run every benchmark in turn (each writes its results and its docs table).

python -m bench.run_all                      # all of them
python -m bench.run_all --only decode_scaling
python -m bench.run_all -- --reps 5          # arguments after -- go to each benchmark
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence

from . import harness as H

# Module names under bench/, in run order. Each has main(argv) -> int.
BENCHMARKS = (
    "decode_scaling",
    "pool_sharing",
    "spawn_ramp",
    "operator_scale",
    "router_overhead",
    "vs_llama_server",
    "kernel_paths",
    "q0_kernels",
    "newcomer_prefill",
    "long_prefix",
    "unified_attention",
    "speculative",
    "pool_restore",
    "agent_crew",
    "session_restore",
    "k8s_restore",
)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, extra = args_in[:cut], args_in[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__)
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    args = p.parse_args(args_in)
    chosen = BENCHMARKS
    if args.only:
        chosen = tuple(n.strip() for n in args.only.split(",") if n.strip())
        unknown = sorted(set(chosen) - set(BENCHMARKS))
        if unknown:
            p.error(f"unknown benchmark(s): {', '.join(unknown)}")
    failed: list[str] = []
    t0 = time.monotonic()
    for name in chosen:
        H.progress(f"=== {name}")
        module = importlib.import_module(f"bench.{name}")
        try:
            rc = int(module.main(extra))
        except H.BenchError as exc:
            H.progress(f"{name} failed: {exc}")
            rc = 1
        if rc:
            failed.append(name)
    H.progress(f"all benchmarks done in {time.monotonic() - t0:.0f}s")
    if failed:
        H.progress(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
