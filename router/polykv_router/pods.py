"""An engine pod as the router needs it, read from a Pod object (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    uid: str
    ip: str
    port: int
    ready: bool
    """The pod's Ready condition: containers ready and every readiness gate true (for an
    engine, the operator's gate says its pools are materialized)."""
    terminating: bool
    """deletionTimestamp set: it finishes what it runs, and takes no new session."""

    @property
    def serving(self) -> bool:
        """May take new sessions."""
        return self.ready and not self.terminating

    @property
    def base_url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip  # an IPv6 pod address
        return f"http://{host}:{self.port}"


def pod_from_object(obj: Mapping[str, Any], default_port: int) -> Pod | None:
    """The pod, or None when it has no address or has finished (it can hold no session).

    The port is the container port named ``http`` when the pod declares one (the operator's
    engine pods do), else ``default_port``."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") in ("Succeeded", "Failed"):
        return None
    port = default_port
    for container in spec.get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http" and isinstance(p.get("containerPort"), int):
                port = p["containerPort"]
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return Pod(
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        ip=str(ip),
        port=port,
        ready=ready,
        terminating=bool(meta.get("deletionTimestamp")),
    )
