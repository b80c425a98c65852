"""The facts about an engine pod that the rounds and the gates use, read from its status."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .fleet import ReplicaRef
from .gates import GATE
from .manifests import CONTAINER


def replica_ref(name: str, uid: str, body: Mapping[str, Any]) -> ReplicaRef:
    st = body.get("status") or {}
    containers = {c.get("name"): c for c in st.get("containerStatuses") or []}
    c = containers.get(CONTAINER) or {}
    state = c.get("state") or {}
    waiting = state.get("waiting") or {}
    conditions = st.get("conditions") or []
    gate = next((x.get("status") for x in conditions if x.get("type") == GATE), None)
    return ReplicaRef(
        name=name,
        uid=uid,
        ip=st.get("podIP") or None,
        running="running" in state,
        ready=bool(c.get("ready")),
        gate=gate,
        terminating=bool((body.get("metadata") or {}).get("deletionTimestamp")),
        restarts=int(c.get("restartCount") or 0),
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
    )
