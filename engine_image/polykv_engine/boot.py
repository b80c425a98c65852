"""The ``polykv-engine`` entry point's first step: size the compute threads against the CPUs
the process may really use and resolve the OpenMP wait policy, both before libllama loads
(libgomp reads its variables once, when it loads), then hand over to the command line.

Only ``-t``/``-tb`` (and their ``LLAMA_ARG_*`` variables) are read here; everything else, and
any error in these two, is the full parser's job in ``cli``.
"""

from __future__ import annotations

import argparse
import os
import sys

from polykv_engine.llama.omp import AUTO, ENV, OMP_POLICY_NAMES, decide_once


def requested_threads(argv: list[str]) -> int | None:
    """The larger of ``-t`` and ``-tb`` as given (None where unset, 0 or unreadable)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    p.add_argument("-t", "--threads", type=int, default=os.environ.get("LLAMA_ARG_THREADS"))
    p.add_argument(
        "-tb", "--threads-batch", type=int, default=os.environ.get("LLAMA_ARG_THREADS_BATCH")
    )
    try:
        known, _ = p.parse_known_args(argv)
        given = [int(v) for v in (known.threads, known.threads_batch) if v is not None]
    except (argparse.ArgumentError, ValueError):
        return None
    return max((v for v in given if v > 0), default=None)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    policy = os.environ.get(ENV, AUTO)
    if policy not in OMP_POLICY_NAMES:
        print(
            f"polykv-engine: error: {ENV}={policy!r} is not one of {', '.join(OMP_POLICY_NAMES)}",
            file=sys.stderr,
        )
        return 2
    decide_once(requested_threads(args))
    from polykv_engine.cli import main as cli_main  # loads libllama: after the decision

    return cli_main(args)
