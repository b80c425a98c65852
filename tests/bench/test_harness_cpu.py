"""The benchmarks' accounting of whose CPU time is whose."""

from __future__ import annotations

import subprocess
import sys

from bench.harness import TreeCpuWatch, descendants


def test_descendants_follow_every_branch_and_nothing_else() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 21: 20}
    assert descendants(parents, 10) == {10, 11, 12, 13}
    assert descendants(parents, 13) == {13}
    assert descendants(parents, 99) == {99}  # gone meanwhile: itself only


def test_a_reaped_child_counts_as_our_own_work() -> None:
    """A child that used a second of CPU and ended before the watch did is counted once
    reaped, not as another process's load (CPU time, not wall time: load cannot move it)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1: pass"
    with TreeCpuWatch() as cpu:
        subprocess.run([sys.executable, "-c", burn], check=True)
    assert cpu.own_cpu_s >= 0.95
