"""Child processes with a log file each, stopped as a whole process group."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger("polykv.testenv.procs")


class ManagedProcess:
    """One long-running child. Its stdout and stderr go to `log_path` (appended)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            out.write(f"--- start {time.strftime('%H:%M:%S')}: {' '.join(self.argv)}\n".encode())
            out.flush()
            # A new session: stop() can signal the whole group, and a Ctrl-C in the
            # terminal reaches the harness only, which then tears down in order.
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        log.info("started %s pid=%d log=%s", self.name, self.proc.pid, self.log_path)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, SIGKILL after `grace_s`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0fs; killing", self.name, grace_s)
                signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Reap anything the child left in its group.
        signal_group(self.proc.pid, signal.SIGKILL)
        log.info("stopped %s rc=%s", self.name, self.proc.returncode)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the group at once (crash tests)."""
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_pid_gone(pid: int, timeout_s: float) -> bool:
    """For processes we did not spawn (polykv-dev down): poll until the pid is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
