"""What the operator knows about each engine fleet between rounds (in memory only).

Written by the engine round (engine_round.py) and read by the status computations. Everything
here can be rebuilt from the cluster and the engines: after an operator restart the first
round polls every replica again and re-validates every pool (dry runs create nothing).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polykv_api import models as wire

from .names import CONTAINER, GATE

EngineKey = tuple[str, str]  # (namespace, engine name)

RENDER_RETRY_S = 30.0  # a rejected prefix is asked about again after this long


@dataclass(frozen=True)
class ReplicaRef:
    """An engine pod as the index saw it."""

    name: str
    uid: str
    ip: str | None
    running: bool  # the engine container's process is running
    ready: bool  # ... and passes its readiness probe (the engine is up)
    gate: str | None  # our readiness gate condition: "True", "False" or None (absent)
    terminating: bool = False
    restarts: int = 0
    waiting_reason: str | None = None  # e.g. CrashLoopBackOff, RunContainerError
    waiting_message: str | None = None

    @classmethod
    def from_pod(cls, body: Mapping[str, Any]) -> ReplicaRef:
        """The facts the rounds and the gates use, read from a Pod object."""
        meta = body.get("metadata") or {}
        st = body.get("status") or {}
        containers = {c.get("name"): c for c in st.get("containerStatuses") or []}
        c = containers.get(CONTAINER) or {}
        state = c.get("state") or {}
        waiting = state.get("waiting") or {}
        conditions = st.get("conditions") or []
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            ip=st.get("podIP") or None,
            running="running" in state,
            ready=bool(c.get("ready")),
            gate=next((x.get("status") for x in conditions if x.get("type") == GATE), None),
            terminating=bool(meta.get("deletionTimestamp")),
            restarts=int(c.get("restartCount") or 0),
            waiting_reason=waiting.get("reason"),
            waiting_message=waiting.get("message"),
        )


@dataclass
class Observation:
    """One replica at the last poll: its pool listing, which carries each pool's live
    figures, admission policy and capacity summary."""

    pod: str
    uid: str
    ip: str | None
    reachable: bool
    error: str | None = None
    listing: wire.PoolList | None = None
    at: float = field(default_factory=time.time)

    def pool(self, name: str) -> wire.PoolStatus | None:
        if self.listing is None:
            return None
        for p in self.listing.pools:
            if p.name == name:
                return p
        return None

    @property
    def boot_id(self) -> str | None:
        return self.listing.boot_id if self.listing is not None else None


@dataclass(frozen=True)
class Render:
    """A pool's prefix as the engine rendered it (the same on every replica: same model)."""

    prefix_len: int
    branch_pos: int
    prefix_hash: str


@dataclass(frozen=True)
class RenderFailure:
    """The engine (or the operator's own check) refused the prefix: a spec problem."""

    reason: str
    message: str
    at: float = field(default_factory=time.time)

    def expired(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) - self.at > RENDER_RETRY_S


@dataclass(frozen=True)
class CreateError:
    """Why creating a pool on one replica failed."""

    message: str
    capacity: bool = False  # the engine has no free pool sequence id


@dataclass(frozen=True)
class Synced:
    """The replica incarnation whose readiness gate we turned True."""

    boot_id: str
    restarts: int


@dataclass
class EngineState:
    key: EngineKey
    admin_key: str | None = None
    replicas: dict[str, Observation] = field(default_factory=dict)  # pod name -> last poll
    pods: dict[str, ReplicaRef] = field(default_factory=dict)  # pod name -> last seen
    renders: dict[str, Render | RenderFailure] = field(default_factory=dict)  # pool uid ->
    # pool uid -> pod -> why creating it there failed (a capacity or name clash, say)
    create_errors: dict[str, dict[str, CreateError]] = field(default_factory=dict)
    policy_errors: dict[str, str] = field(default_factory=dict)  # pool name -> message
    synced: dict[str, Synced] = field(default_factory=dict)  # pod uid ->
    deleting: set[str] = field(default_factory=set)  # pool uids whose release has begun
    rounds: int = 0
    mean_active_tps: float | None = None
    # Serializes engine mutations: a round's creates against a delete handler's releases.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def forget_pool(self, uid: str) -> None:
        """A pool released everywhere: nothing about it is worth keeping."""
        self.renders.pop(uid, None)
        self.create_errors.pop(uid, None)
        self.deleting.discard(uid)


class Fleet:
    """All engines this operator process serves."""

    def __init__(self) -> None:
        self.engines: dict[EngineKey, EngineState] = {}

    def get(self, namespace: str, name: str) -> EngineState:
        key = (namespace, name)
        state = self.engines.get(key)
        if state is None:
            state = self.engines[key] = EngineState(key)
        return state

    def peek(self, namespace: str, name: str) -> EngineState | None:
        return self.engines.get((namespace, name))

    def forget(self, namespace: str, name: str) -> None:
        self.engines.pop((namespace, name), None)
