"""One container of a pod as a local process: start, exit, restart with back-off, probes,
and the containerStatus a kubelet would report for it."""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kubeapi import Obj
from ..procs import ProcessLedger, signal_group
from . import probes
from .images import UnknownImage
from .podenv import ConfigError

log = logging.getLogger("polykv.testenv.node.container")

# Back-off before the n-th restart in a row: the kubelet uses 10 s doubling to 5 min;
# local processes start in milliseconds, so tests get a much shorter ladder.
BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)
# A container that ran this long has its back-off reset (the kubelet uses 10 minutes).
BACKOFF_RESET_S = 60.0


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    image_id: str


# Raised by a launcher: the container stays Waiting (retried every few seconds).
LaunchError = (ConfigError, UnknownImage)

Emit = Callable[[str, str, str], None]  # (event type, reason, message)


class ContainerRunner:
    def __init__(
        self,
        spec: Obj,
        restart_policy: str,
        launcher: Callable[[], Launch],
        log_dir: Path,
        emit: Emit,
        grace_s: float = 30.0,
        ledger: ProcessLedger | None = None,
    ) -> None:
        self.spec = spec
        self.ledger = ledger
        self.grace_s = grace_s
        self.name: str = spec["name"]
        self.restart_policy = restart_policy
        self.launcher = launcher
        self.log_dir = log_dir
        self.emit = emit
        self.proc: subprocess.Popen[bytes] | None = None
        self.image_id = ""
        self.env: dict[str, str] = {}
        self.restart_count = 0
        self.started_at = ""
        self.started_mono = 0.0
        self.waiting: tuple[str, str] | None = ("ContainerCreating", "")
        self.terminated: Obj | None = None  # current state when not running
        self.last_terminated: Obj | None = None
        self.next_start_at = 0.0
        self.backoff_step = 0
        self.stopping = False
        self.kill_at: float | None = None
        self.kill_reason = ""
        self.named_ports = {
            p["name"]: int(p["containerPort"]) for p in spec.get("ports") or [] if p.get("name")
        }
        self.readiness: probes.Prober | None = None
        self.liveness: probes.Prober | None = None
        self.startup: probes.Prober | None = None
        self.ever_started = False

    # -- state -----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def started(self) -> bool:
        return self.running and (self.startup is None or self.startup.result is True)

    @property
    def ready(self) -> bool:
        if not self.started or self.stopping:
            return False
        return self.readiness is None or self.readiness.result is True

    @property
    def finished(self) -> bool:
        """Exited and will not be restarted."""
        return self.terminated is not None and not self._will_restart(self.terminated)

    @property
    def succeeded(self) -> bool:
        return self.terminated is not None and self.terminated["exitCode"] == 0

    def _will_restart(self, term: Obj) -> bool:
        if self.stopping:
            return False
        if self.restart_policy == "Always":
            return True
        return self.restart_policy == "OnFailure" and term["exitCode"] != 0

    # -- driving ---------------------------------------------------------------------

    def tick(self, host: str, now: float) -> None:
        if self.proc is not None:
            code = self.proc.poll()
            if code is not None:
                self._exited(code, now)
            elif self.kill_at is not None and now >= self.kill_at:
                signal_group(self.proc.pid, signal.SIGKILL)
                self.kill_at = None
            else:
                self._probe(host, now)
        may_start = self.terminated is None or self._will_restart(self.terminated)
        if self.proc is None and not self.stopping and now >= self.next_start_at and may_start:
            self._start(now)

    def _start(self, now: float) -> None:
        try:
            launch = self.launcher()
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{self.restart_count}.log"
            with log_path.open("ab") as out:
                self.proc = subprocess.Popen(
                    launch.argv,
                    env=launch.env,
                    cwd=launch.cwd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group, killed as a whole
                )
        except (*LaunchError, OSError) as exc:
            reason = (
                "ErrImagePull"
                if isinstance(exc, UnknownImage)
                else "CreateContainerConfigError"
                if isinstance(exc, ConfigError)
                else "RunContainerError"
            )
            if self.waiting is None or self.waiting[0] != reason:
                self.emit("Warning", "Failed", f"{self.name}: {exc}")
                log.warning("container %s cannot start: %s", self.name, exc)
            self.waiting = (reason, str(exc))
            self.next_start_at = now + 5.0
            return
        if self.ledger is not None:
            self.ledger.add(self.proc.pid, f"container {self.name}")
        self.image_id, self.env = launch.image_id, launch.env
        self.started_at, self.started_mono = now_iso(), now
        self.waiting, self.terminated = None, None
        self.readiness = probes.make("readiness", self.spec, now)
        self.liveness = probes.make("liveness", self.spec, now)
        self.startup = probes.make("startup", self.spec, now)
        self.ever_started = True
        log.info(
            "container started name=%s pid=%d restarts=%d log=%s argv=%s",
            self.name,
            self.proc.pid,
            self.restart_count,
            log_path,
            launch.argv,
        )
        self.emit("Normal", "Started", f"Started container {self.name} (pid {self.proc.pid})")

    def _exited(self, code: int, now: float) -> None:
        # A negative code is a signal; container runtimes report 128 + signal number.
        exit_code = 128 - code if code < 0 else code
        reason = "Completed" if exit_code == 0 else "Error"
        term: Obj = {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": self.started_at,
            "finishedAt": now_iso(),
            "containerID": f"process://{self.pid}",
        }
        if code < 0:
            term["signal"] = -code
        if self.kill_reason:
            term["message"] = self.kill_reason
        log.info("container exited name=%s pid=%s exit=%d", self.name, self.pid, exit_code)
        if self.ledger is not None and self.pid is not None:
            signal_group(self.pid, signal.SIGKILL)  # whatever it left in its group
            self.ledger.remove(self.pid)
        self.proc, self.kill_at, self.kill_reason = None, None, ""
        self.terminated = term
        if now - self.started_mono >= BACKOFF_RESET_S:
            self.backoff_step = 0
        if self._will_restart(term):
            delay = BACKOFF_S[min(self.backoff_step, len(BACKOFF_S) - 1)]
            self.backoff_step += 1
            self.next_start_at = now + delay
            self.last_terminated = term
            self.restart_count += 1
            self.terminated = None
            self.waiting = ("CrashLoopBackOff", f"back-off {delay:.0f}s restarting {self.name}")
            if delay > 0:
                self.emit("Warning", "BackOff", f"Back-off {delay:.0f}s restarting {self.name}")

    def _probe(self, host: str, now: float) -> None:
        if self.startup is not None and self.startup.result is not True:
            if self.startup.run(host, self.named_ports, self.env, now) is False:
                self._kill_for_probe("Startup", self.startup, now)
            return
        live = self.liveness
        if live is not None and live.run(host, self.named_ports, self.env, now) is False:
            self._kill_for_probe("Liveness", live, now)
            return
        if self.readiness is not None:
            before = self.readiness.result
            after = self.readiness.run(host, self.named_ports, self.env, now)
            if after is False and before is not False:
                self.emit(
                    "Warning",
                    "Unhealthy",
                    f"Readiness probe failed: {self.readiness.last_message}",
                )

    def _kill_for_probe(self, what: str, prober: probes.Prober, now: float) -> None:
        if self.kill_at is not None:
            return
        msg = f"{what} probe failed: {prober.last_message}"
        self.emit("Warning", "Unhealthy", msg)
        self.emit("Normal", "Killing", f"Container {self.name} failed {what.lower()} probe")
        self.kill_reason = msg
        self.term(now, self.grace_s)

    # -- stopping --------------------------------------------------------------------

    def term(self, now: float, grace_s: float) -> None:
        """SIGTERM now, SIGKILL at now + grace_s (enforced by tick)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        signal_group(self.proc.pid, signal.SIGTERM)
        self.kill_at = now + grace_s

    def stop(self, now: float, grace_s: float) -> None:
        """For pod deletion: no more restarts; tick until `running` is False."""
        self.stopping = True
        self.term(now, grace_s)

    def kill_now(self) -> None:
        if self.proc is not None:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            if self.ledger is not None:
                self.ledger.remove(self.proc.pid)

    # -- status ----------------------------------------------------------------------

    def status(self) -> Obj:
        st: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": self.image_id,
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
        }
        if self.running:
            st["state"] = {"running": {"startedAt": self.started_at}}
            st["containerID"] = f"process://{self.pid}"
        elif self.terminated is not None:
            st["state"] = {"terminated": self.terminated}
            st["containerID"] = self.terminated["containerID"]
        else:
            reason, message = self.waiting or ("ContainerCreating", "")
            st["state"] = {
                "waiting": {"reason": reason, **({"message": message} if message else {})}
            }
        st["lastState"] = {"terminated": self.last_terminated} if self.last_terminated else {}
        return st


def base_environment() -> Mapping[str, str]:
    """What every "container" inherits: the node's own environment (the local machine is
    the image), minus the client settings that belong to the harness and the OpenMP wait
    variables (a test process that loaded libllama wrote its own there; an engine in a pod
    decides for its own CPU limit, as in a real container)."""
    drop = {"KUBECONFIG", "POLYKV_IMAGE_TABLE", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}
    return {k: v for k, v in os.environ.items() if k not in drop}
