"""`polykv-dev up|down --dir D` stops only what it started: the processes its daemon
recorded (pid and start time), never a process found by its command line or directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from polykv_testenv.cleanup import ledger

from ..helpers import eventually, pid_alive

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

DEV = str(Path(sys.executable).parent / "polykv-dev")


def test_down_after_a_crashed_daemon_stops_its_processes_and_nothing_else(
    tmp_path: Path,
) -> None:
    d = tmp_path / "dev"
    (d / "node").mkdir(parents=True)
    # Bystanders that name D on their command line or run in its node/ directory, as the
    # caller's own wrappers and unrelated jobs may: none is polykv-dev's to stop.
    named = subprocess.Popen(["bash", "-c", f"sleep 600; echo {d}/probe"])
    inside = subprocess.Popen(["sleep", "600"], cwd=d / "node")
    recorded = []
    try:
        up = subprocess.run(
            [DEV, "--dir", str(d), "up", "--timeout", "240"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        daemon = json.loads((d / "info.json").read_text())["pid"]
        recorded = ledger(d).entries()
        names = {e.name for e in recorded}
        assert {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"} <= names
        assert all(e.alive() for e in recorded)
        os.kill(daemon, signal.SIGKILL)  # the daemon dies; its components run on
        eventually("daemon gone", lambda: True if not pid_alive(daemon) else None, 30)
        assert all(e.alive() for e in recorded)
        # Through a wrapper whose command line names D, as a caller's `timeout` does.
        down = subprocess.run(
            ["timeout", "120", DEV, "--dir", str(d), "down"],
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"{len(recorded)} leftover" in down.stdout, down.stdout
        assert not any(e.alive() for e in recorded)
        assert named.poll() is None and inside.poll() is None  # bystanders untouched
        again = subprocess.run([DEV, "--dir", str(d), "down"], capture_output=True, text=True)
        assert again.returncode == 0 and "not running" in again.stdout
    finally:
        subprocess.run([DEV, "--dir", str(d), "down"], capture_output=True, timeout=150)
        for p in (named, inside):
            p.kill()
            p.wait()
