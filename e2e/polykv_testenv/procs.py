"""Child processes with a log file each, stopped as a whole process group; and the ledger
in which a long-lived owner (the `polykv-dev` daemon) records every process it starts, so
that whoever cleans up after it stops exactly those and nothing else."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
        ledger: ProcessLedger | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.ledger = ledger
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
        if self.ledger is not None:
            self.ledger.add(self.proc.pid, self.name)
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
        if self.ledger is not None:
            self.ledger.remove(self.proc.pid)
        log.info("stopped %s rc=%s", self.name, self.proc.returncode)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the group at once (crash tests)."""
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc is not None and self.ledger is not None:
            self.ledger.remove(self.proc.pid)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/<pid>/stat, field 22); None when
    there is no such process. A pid is reused; a (pid, start) pair is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


@dataclass(frozen=True)
class Recorded:
    pid: int
    start: int
    name: str

    def alive(self) -> bool:
        """The very process we recorded still runs (not another one under a reused pid)."""
        return start_ticks(self.pid) == self.start


class ProcessLedger:
    """A JSON file of the processes an owner started, each by pid and start time. Every one
    was started in a new session, so it leads its own process group. Thread-safe within one
    process; rewritten atomically so a reader never sees half a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def _read(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, data: dict[str, dict[str, object]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)

    def add(self, pid: int, name: str) -> None:
        start = start_ticks(pid)
        if start is None:
            return  # gone already: nothing to stop later
        with self._lock:
            data = self._read()
            data[str(pid)] = {"start": start, "name": name}
            self._write(data)

    def remove(self, pid: int) -> None:
        with self._lock:
            data = self._read()
            if data.pop(str(pid), None) is not None:
                self._write(data)

    def entries(self) -> list[Recorded]:
        out = []
        for pid, e in self._read().items():
            try:
                out.append(Recorded(int(pid), int(str(e["start"])), str(e["name"])))
            except (KeyError, ValueError):
                continue
        return out

    def clear(self) -> None:
        with self._lock:
            self.path.unlink(missing_ok=True)


def kill_recorded(entry: Recorded) -> bool:
    """SIGKILL a recorded process and its group, after checking it is the one recorded and
    still leads its own group. False when it had gone (or is someone else now)."""
    if not entry.alive():
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(entry.pid) == entry.pid:
            os.killpg(entry.pid, signal.SIGKILL)
        else:
            os.kill(entry.pid, signal.SIGKILL)
    return True


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
