"""Shared by the router's tests (here and in tests/e2e/polykv): a router process, a pool
made to refuse new sessions for real, and Prometheus samples."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from polykv_testenv.waiting import NotReady, free_port, wait_for

Headers = Mapping[str, str]
PREFIX = "You are the research crew. Cite sources, be brief. Tools: search, fetch."


def pool_prefix(pool: str) -> str:
    """Each pool its own prefix: a slot another pool's session left behind then shares
    almost nothing with a new session, which attaches to its pool rather than reusing the
    slot's own cache."""
    return f"Pool {pool}. {PREFIX}"


@dataclass
class RouterProcess:
    """``polykv-router`` as a child process in static mode (fixed replicas, no Kubernetes)."""

    replicas: Mapping[str, str]  # name -> base URL
    log_path: Path
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to this process's environment (keys: POLYKV_ROUTER_KEY, ...)."""
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    runs: int = field(default=0)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RouterProcess:
        self.port = self.port or free_port()
        argv = [sys.executable, "-m", "polykv_router.cli", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--log-format", "json", *self.args]
        for name, url in self.replicas.items():
            argv += ["--replica", f"{name}={url.removeprefix('http://')}"]
        with open(self.log_path, "ab") as log:
            env = {**os.environ, **self.env}
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.runs += 1
        proc = self.proc
        wait_for(
            "router ready",
            lambda: httpx.get(self.base_url + "/readyz", timeout=5).status_code == 200 or None,
            timeout_s=60,
            alive=lambda: proc.poll() is None,
        )
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> RouterProcess:
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def create_pool(client: httpx.Client, name: str, headers: Headers | None = None) -> None:
    body = {"name": name, "prompt": pool_prefix(name)}
    r = client.post("/polykv/pools", json=body, headers=headers)
    assert r.status_code in (200, 201), r.text


def saturate(
    client: httpx.Client, pool: str, settle_max_ms: int, headers: Headers | None = None
) -> None:
    """Makes ``pool`` on this replica refuse new sessions for real (429 tps_floor, Retry-After
    = settle_max_ms in whole seconds): an enforced floor no CPU can reach, and one guaranteed
    session that decodes long enough for the engine to settle a measured mean (a turn more
    if one was not enough). The refusal then holds for the engine's idle-estimate window
    (30 s) after that session's last turn."""
    policy = {
        "target_tps_per_session": 1e6,
        "mode": "enforced",
        "on_saturation": "reject",
        "guarantee_min_sessions": 1,
        "settle_tokens": 4,
        "settle_max_ms": settle_max_ms,
    }
    r = client.post(f"/polykv/pools/{pool}/admission", json=policy, headers=headers)
    assert r.status_code == 200, r.text
    prompt = pool_prefix(pool) + " Survey"
    body = {"pool_id": pool, "prompt": prompt, "n_predict": 600, "ignore_eos": True}
    sid = {"x-session-id": f"saturating-{pool}-{time.monotonic_ns()}"}

    last: dict[str, object] = {}

    def refusing() -> bool | None:
        # One more turn of the saturating session (a continuation: never gated); the engine
        # settles a mean while it decodes, then judges new sessions from it.
        r = client.post("/completion", json=body, headers={**(headers or {}), **sid})
        assert r.status_code == 200, r.text
        last.update(client.get(f"/polykv/pools/{pool}/capacity", headers=headers).json())
        return True if not last["can_admit"] and last["reason_code"] == "tps_floor" else None

    try:
        wait_for(f"pool {pool} refusing on {client.base_url}", refusing, timeout_s=60)
    except NotReady as exc:
        raise NotReady(f"{exc}; last capacity: {last}") from None


def total(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus exposition's samples of ``name`` whose labels include
    ``labels`` (0 when there are none)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    out = 0.0
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, _, value = line.rpartition(" ")
        metric, _, rest = series.partition("{")
        if metric == name and want <= set(rest.rstrip("}").split(",")):
            out += float(value)
    return out


def metrics(base_url: str, headers: Headers | None = None) -> str:
    with contextlib.closing(httpx.Client(timeout=30)) as c:
        r = c.get(base_url + "/metrics", headers=headers)
        r.raise_for_status()
        return r.text


def assert_same_stream(direct: bytes, routed: bytes, tokens: int) -> None:
    """Two /completion streams of the same greedy request: every token event byte for byte,
    and the closing event equal but for its timings and per-run fields."""
    frames = [[f for f in raw.split(b"\n\n") if f] for raw in (direct, routed)]
    assert len(frames[0]) == len(frames[1]) == tokens + 1
    assert frames[0][:-1] == frames[1][:-1]
    volatile = {"timings", "polykv", "generation_settings", "id_slot"}
    last = [{k: v for k, v in json.loads(f[-1][6:]).items() if k not in volatile} for f in frames]
    assert last[0] == last[1]
