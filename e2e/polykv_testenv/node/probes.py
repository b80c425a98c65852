"""Readiness, liveness and startup probes with the kubelet's timing and thresholds."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections.abc import Mapping

import httpx

from ..kubeapi import Obj

log = logging.getLogger("polykv.testenv.node.probes")


def _port(value: int | str, named_ports: Mapping[str, int]) -> int:
    if isinstance(value, int):
        return value
    if value.isdigit():
        return int(value)
    if value not in named_ports:
        raise ValueError(f"probe names unknown port {value!r}")
    return named_ports[value]


class Prober:
    """One probe of one container. `result` is None until the first verdict."""

    def __init__(self, kind: str, spec: Obj, started_at: float) -> None:
        self.kind = kind
        self.spec = spec
        self.initial_delay = float(spec.get("initialDelaySeconds", 0))
        self.period = float(spec.get("periodSeconds", 10))
        self.timeout = float(spec.get("timeoutSeconds", 1))
        self.success_threshold = int(spec.get("successThreshold", 1))
        self.failure_threshold = int(spec.get("failureThreshold", 3))
        self.started_at = started_at
        self.next_at = started_at + self.initial_delay
        self.successes = 0
        self.failures = 0
        self.result: bool | None = None
        self.last_message = ""

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def run(
        self, host: str, named_ports: Mapping[str, int], env: Mapping[str, str], now: float
    ) -> bool | None:
        """Runs the probe if due; returns the (possibly unchanged) verdict."""
        if not self.due(now):
            return self.result
        self.next_at = now + self.period
        ok, message = self._check(host, named_ports, env)
        self.last_message = message
        if ok:
            self.successes += 1
            self.failures = 0
            if self.successes >= self.success_threshold:
                self.result = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= self.failure_threshold:
                self.result = False
        return self.result

    def _check(
        self, host: str, named_ports: Mapping[str, int], env: Mapping[str, str]
    ) -> tuple[bool, str]:
        spec = self.spec
        try:
            if "httpGet" in spec:
                get: Obj = spec["httpGet"]
                scheme = str(get.get("scheme", "HTTP")).lower()
                port = _port(get["port"], named_ports)
                target = get.get("host") or host
                url = f"{scheme}://{target}:{port}{get.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
                # Like the kubelet: no certificate checks, redirects followed, 2xx/3xx pass.
                r = httpx.get(
                    url, headers=headers, timeout=self.timeout, verify=False, follow_redirects=True
                )
                return (
                    200 <= r.status_code < 400,
                    f"HTTP probe failed with statuscode: {r.status_code}",
                )
            if "tcpSocket" in spec:
                tcp: Obj = spec["tcpSocket"]
                port = _port(tcp["port"], named_ports)
                with socket.create_connection((tcp.get("host") or host, port), self.timeout):
                    return True, ""
            if "exec" in spec:
                out = subprocess.run(
                    spec["exec"]["command"],
                    env=dict(env),
                    capture_output=True,
                    timeout=self.timeout,
                    check=False,
                )
                return out.returncode == 0, out.stdout.decode(errors="replace")[-200:]
            return False, f"unsupported {self.kind} probe handler {sorted(spec)}"
        except (httpx.HTTPError, OSError, subprocess.TimeoutExpired, ValueError) as exc:
            return False, f"{self.kind} probe failed: {exc}"


def make(kind: str, container: Obj, started_at: float | None = None) -> Prober | None:
    spec = container.get(f"{kind}Probe")
    if not spec:
        return None
    return Prober(kind, spec, time.monotonic() if started_at is None else started_at)
