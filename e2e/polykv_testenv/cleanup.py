"""Stops what a `polykv-dev` daemon that died without tearing down (SIGKILL, OOM) left
running: exactly the processes it recorded in its ledger (pid and start time, each the
leader of its own process group), never anything found by name, path or command line."""

from __future__ import annotations

import logging
from pathlib import Path

from .procs import ProcessLedger, kill_recorded, wait_pid_gone

log = logging.getLogger("polykv.testenv.cleanup")

LEDGER = "processes.json"


def ledger(dev_dir: Path) -> ProcessLedger:
    """Where the daemon of `dev_dir` records every process it starts."""
    return ProcessLedger(dev_dir / LEDGER)


def kill_leftovers(dev_dir: Path) -> int:
    """Kills the recorded processes that still run (same pid, same start time); returns how
    many. The ledger is emptied: what is not running any more is nobody's to stop."""
    book = ledger(dev_dir)
    killed = []
    for entry in book.entries():
        if kill_recorded(entry):
            log.warning("killing leftover %s pid=%d", entry.name, entry.pid)
            killed.append(entry.pid)
    for pid in killed:
        wait_pid_gone(pid, 5)
    book.clear()
    return len(killed)
