"""Engine replicas from the Kubernetes API: list, then watch, the engine's pods.

Pods, not Endpoints: the router needs a pod's name, uid, address, readiness and whether it
is terminating (a terminating replica still serves the sessions it holds), and Endpoints
cannot hold the loopback pod addresses of the local test cluster. Credentials are the pod's
service account (token, CA, namespace in the projected directory), re-read on every request
because the kubelet rotates the token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .fleet import Fleet
from .pods import pod_from_object

log = logging.getLogger("polykv.router.kube")

WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; we resume from its version


class KubeError(Exception):
    pass


class Expired(KubeError):
    """410 Gone: our resourceVersion is too old; list again."""


@dataclass(frozen=True, slots=True)
class InCluster:
    server: str
    token_file: Path
    ca_file: Path
    namespace: str

    @classmethod
    def load(cls, sa_dir: Path, env: Mapping[str, str], namespace: str | None) -> InCluster:
        host = env.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise KubeError("KUBERNETES_SERVICE_HOST is not set: not running in a cluster")
        port = env.get("KUBERNETES_SERVICE_PORT", "443")
        host = f"[{host}]" if ":" in host else host
        ns = namespace
        if ns is None:
            try:
                ns = (sa_dir / "namespace").read_text().strip()
            except OSError as exc:
                raise KubeError(f"no namespace given and none in {sa_dir}: {exc}") from None
        return cls(f"https://{host}:{port}", sa_dir / "token", sa_dir / "ca.crt", ns)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))


class PodWatch:
    """Keeps ``fleet`` equal to the pods matching ``selector``; ``synced`` once listed."""

    def __init__(
        self,
        creds: InCluster,
        selector: str,
        default_port: int,
        fleet: Fleet,
        http: aiohttp.ClientSession,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.creds = creds
        self.selector = selector
        self.default_port = default_port
        self.fleet = fleet
        self.http = http
        self.on_change = on_change
        self.synced = False
        self.ssl = creds.ssl_context()
        self.path = f"{creds.server}/api/v1/namespaces/{creds.namespace}/pods"

    async def run(self) -> None:
        backoff = 0.5
        while True:
            try:
                version = await self._list()
                self.synced = True
                backoff = 0.5
                while True:
                    version = await self._watch(version)
            except Expired:
                log.info("pod watch expired; listing again")
            except asyncio.CancelledError:
                raise
            except (TimeoutError, KubeError, aiohttp.ClientError, OSError) as exc:
                log.warning("pod watch failed: %s", exc, extra={"fields": {"retry_in_s": backoff}})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _list(self) -> str:
        params = {"labelSelector": self.selector}
        async with self.http.get(
            self.path, params=params, headers=self.creds.headers(), ssl=self.ssl,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:  # fmt: skip
            raw = await resp.read()
            if resp.status != 200:
                raise KubeError(f"list pods: HTTP {resp.status}: {raw[:300]!r}")
        doc = json.loads(raw)
        pods = [pod_from_object(p, self.default_port) for p in doc.get("items") or []]
        self.fleet.replace(p for p in pods if p is not None)
        self.on_change()
        log.info("engine pods listed", extra={"fields": {"pods": len(self.fleet)}})
        return str(doc["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        params = {
            "labelSelector": self.selector,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=WATCH_TIMEOUT_S + 30)
        async with self.http.get(
            self.path, params=params, headers=self.creds.headers(), ssl=self.ssl, timeout=timeout
        ) as resp:
            if resp.status == 410:
                raise Expired()
            if resp.status != 200:
                raw = await resp.read()
                raise KubeError(f"watch pods: HTTP {resp.status}: {raw[:300]!r}")
            async for event in _lines(resp.content):
                version = self._apply(event, version)
        return version

    def _apply(self, event: dict[str, Any], version: str) -> str:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Expired()
            raise KubeError(f"watch error: {obj.get('message')}")
        meta = obj.get("metadata") or {}
        version = str(meta.get("resourceVersion") or version)
        if kind == "BOOKMARK":
            return version
        name = str(meta.get("name", ""))
        pod = pod_from_object(obj, self.default_port) if kind != "DELETED" else None
        if pod is None:
            self.fleet.remove(name)
        else:
            self.fleet.upsert(pod)
        self.on_change()
        log.debug("pod %s %s", name, kind, extra={"fields": {"pod": name, "event": kind}})
        return version


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """Watch events, one JSON object per line (any length: a pod can exceed a read buffer)."""
    buf = b""
    async for chunk in stream.iter_any():
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)
