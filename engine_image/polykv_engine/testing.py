"""Start ``polykv-engine`` as a child process and wait until it serves (tests, bench, demo).

A real process on a real port: tests can kill it, restart it and talk to it over HTTP the
way clients do. Its log goes to a file so a failure can show what the engine said.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from polykv_engine.llama import omp


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineStartError(RuntimeError):
    pass


@dataclass
class EngineProcess:
    model: Path
    args: Sequence[str] = ()
    host: str = "127.0.0.1"
    port: int = 0
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "polykv_engine",
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]

    def child_env(self) -> dict[str, str]:
        """This process's environment and ``env``, less the OpenMP variables this process's
        own wait-policy decision set (if libllama is loaded here): the engine decides its
        own, for its own thread count."""
        inherited = {k: v for k, v in os.environ.items() if k not in omp.set_by_decision}
        return {**inherited, **self.env}

    def start(self, timeout: float = 120.0, headers: dict[str, str] | None = None) -> None:
        if not self.port:
            self.port = free_port(self.host)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.child_env(),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineStartError(
                    f"engine exited with {self.proc.returncode} during startup:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise EngineStartError(f"engine not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log file)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def engine_starter(logs: Path, timeout: float = 120.0) -> Iterator[Callable[..., EngineProcess]]:
    """`start(model, *args)` starts an engine, its log a file in `logs`; every engine started
    is stopped when the block ends, pass or fail (test fixtures start several)."""
    started: list[EngineProcess] = []

    def start(model: Path, *args: str) -> EngineProcess:
        eng = EngineProcess(model, list(args), log_path=logs / f"{model.stem}-{len(started)}.log")
        started.append(eng)
        eng.start(timeout)
        return eng

    try:
        yield start
    finally:
        for eng in started:
            eng.stop()


@contextlib.contextmanager
def running_engine(
    model: Path, args: Sequence[str] = (), log_path: Path | None = None, timeout: float = 120.0
) -> Iterator[EngineProcess]:
    eng = EngineProcess(model=model, args=args, log_path=log_path)
    eng.start(timeout)
    try:
        yield eng
    finally:
        eng.stop()
