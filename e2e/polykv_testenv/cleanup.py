"""Finds processes left behind by a `polykv-dev` daemon that died without tearing down
(SIGKILL, OOM): every component and pod process names the dev directory in its command
line or runs inside its node/ directory."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

from .procs import signal_group, wait_pid_gone

log = logging.getLogger("polykv.testenv.cleanup")


def leftovers(dev_dir: Path) -> list[int]:
    root = str(dev_dir.resolve())
    pods = str(dev_dir.resolve() / "node")  # pod processes run in their pod's directory
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if root in cmdline or cwd == pods or cwd.startswith(pods + os.sep):
            found.append(int(entry.name))
    return found


def kill_leftovers(dev_dir: Path) -> int:
    pids = leftovers(dev_dir)
    for pid in pids:
        log.warning("killing leftover process pid=%d", pid)
        signal_group(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        wait_pid_gone(pid, 5)
    return len(pids)
