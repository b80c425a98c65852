"""What the operator knows about each engine fleet between rounds (in memory only).

Written by the engine's rounds and loop (engine_round.py, engine_loop.py) and read by the
status computations. Everything here can be rebuilt from the cluster and the engines: after
an operator restart the first round polls every replica again and re-validates every pool
(dry runs create nothing).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polykv_api import models as wire

from .names import CONTAINER, DELETION_COST, GATE

EngineKey = tuple[str, str]  # (namespace, engine name)

RENDER_RETRY_S = 30.0  # a rejected prefix is asked about again after this long
CAPACITY_RETRY_S = 30.0  # a replica full of pools is asked again after this long
FULL = "seq_ids_exhausted"  # the engine's code for "no pool sequence id left"
BUSY = frozenset({"kv_full", "queue_full"})  # codes for "busy now, the same may work later"


def controller_uid(meta: Mapping[str, Any], kind: str, api_version: str) -> str | None:
    """The uid of the object's controller when the controller is a `kind` (None else)."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            ours = ref.get("kind") == kind and ref.get("apiVersion") == api_version
            return str(ref["uid"]) if ours and ref.get("uid") else None
    return None


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
    deletion_cost: str | None = None  # the pod-deletion-cost annotation as the pod has it
    # The engine boot a True gate was raised for, as its message names it (`boot_named`):
    # how an operator that has just started tells a replica it may trust from a restart.
    gate_boot: str | None = None
    # uid of the ReplicaSet that controls the pod (replicas.owned_by follows it to the engine)
    replicaset: str | None = None

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
        gate: Mapping[str, Any] = next((x for x in conditions if x.get("type") == GATE), {})
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            ip=st.get("podIP") or None,
            running="running" in state,
            ready=bool(c.get("ready")),
            gate=gate.get("status"),
            terminating=bool(meta.get("deletionTimestamp")),
            restarts=int(c.get("restartCount") or 0),
            waiting_reason=waiting.get("reason"),
            waiting_message=waiting.get("message"),
            deletion_cost=(meta.get("annotations") or {}).get(DELETION_COST),
            gate_boot=boot_named(gate.get("message")) if gate.get("status") == "True" else None,
            replicaset=controller_uid(meta, "ReplicaSet", "apps/v1"),
        )


_BOOT_IN_MESSAGE = re.compile(r" on boot (\S+)$")


def boot_tag(boot_id: str) -> str:
    """An engine boot id as a gate message names it (ids are random: 12 characters will do)."""
    return boot_id[:12]


def boot_message(n_pools: int, boot_id: str) -> str:
    """The message of a raised gate. It names the engine boot (`boot_tag`) so that a later
    operator run can read back which engine process was put in service."""
    return f"{n_pools} declared pools on boot {boot_tag(boot_id)}"


def boot_named(message: str | None) -> str | None:
    """The boot tag a raised gate's message names (`boot_message`), if any."""
    m = _BOOT_IN_MESSAGE.search(message or "")
    return m.group(1) if m else None


def replica_changed(before: ReplicaRef | None, now: ReplicaRef) -> bool:
    """A change a round should act on (not our own gate write): a new, ready, moved,
    restarted or leaving replica."""
    if before is None:
        return True
    return (before.ready, before.ip, before.restarts, before.terminating) != (
        now.ready,
        now.ip,
        now.restarts,
        now.terminating,
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
    # The engine's ETag for `listing` as it answered; None once we changed it in place.
    etag: str | None = None
    at: float = field(default_factory=time.time)
    _by_name: dict[str, wire.PoolStatus] | None = field(default=None, repr=False, compare=False)
    _indexed: tuple[int, int] = field(default=(0, 0), repr=False, compare=False)

    def pool(self, name: str) -> wire.PoolStatus | None:
        """The pool of that name on this replica (a dict lookup: listings hold hundreds)."""
        if self.listing is None:
            return None
        key = (id(self.listing.pools), len(self.listing.pools))
        if self._by_name is None or self._indexed != key:
            self._by_name = {p.name: p for p in self.listing.pools if p.name is not None}
            self._indexed = key
        return self._by_name.get(name)

    def add_pool(self, pool: wire.PoolStatus) -> None:
        """A pool the engine just created or changed (its own answer), in place of a re-poll."""
        if self.listing is None:
            return
        before = self.pool(pool.name) if pool.name is not None else None
        held = before is not None and before.residency != "evicted"
        holds = pool.residency != "evicted"
        self.listing.seq_ids_used += int(holds) - int(held)  # one sequence id per resident pool
        self.listing.pools = [p for p in self.listing.pools if p.name != pool.name] + [pool]
        self._by_name = None
        self.etag = None  # no longer the engine's bytes: the next poll fetches it whole

    def drop_pool(self, name: str) -> None:
        if self.listing is None:
            return
        self.listing.pools = [p for p in self.listing.pools if p.name != name]
        self._by_name = None
        self.etag = None

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
    reason: str | None = None  # the engine's refusal code; None: no answer
    at: float = field(default_factory=time.time)

    @property
    def capacity(self) -> bool:
        """No free pool sequence id, and no cold pool to evict: it cannot fit there."""
        return self.reason == FULL

    @property
    def busy(self) -> bool:
        """KV or wait queue full: it may fit later."""
        return self.reason in BUSY

    def retry_due(self, now: float | None = None) -> bool:
        """A replica that refused for room is not asked again at every round."""
        waited = (now or time.time()) - self.at
        return not (self.capacity or self.busy) or waited > CAPACITY_RETRY_S


@dataclass(frozen=True)
class Synced:
    """The replica incarnation whose readiness gate we turned True."""

    boot_id: str
    restarts: int


@dataclass(frozen=True)
class Settled:
    """A round after which nothing waited on a retry: until the cluster changes (`changes`,
    the namespace's change count when the round read it) or a replica's listing does,
    another round would do nothing."""

    changes: int
    port: int  # the replicas' port then (a spec change is a cluster change)
    at: float = field(default_factory=time.monotonic)


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
    refused: dict[str, int] = field(default_factory=dict)  # pool uid -> refused releases
    rounds: int = 0  # rounds begun
    rounds_done: int = 0  # rounds of the engine's loop finished, statuses written
    mean_active_tps: float | None = None
    unmanaged_pools: int = 0  # pools no PolyKVPool declares (agent-made), over the replicas
    statuses_key: int | None = None  # the inputs its pools' statuses were last written from
    orphaned_pins: int = 0  # ... of which pinned with no sessions and no children
    # Serializes engine mutations: a round's creates against a delete handler's releases.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set when something changed that a round should act on now (a pool applied, a replica
    # ready, a policy edited); the engine's loop runs at once instead of at the interval.
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # What the loop last wrote, so it writes nothing while the watch has not caught up.
    written: WriteMemo = field(default_factory=lambda: WriteMemo())
    # pod uid -> (pod-deletion-cost sent, the annotation the index showed then)
    costs_sent: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    settled: Settled | None = None  # the last round left nothing pending
    # Why the engine's objects were not written: names other objects hold (engine_objects)
    clash: str | None = None
    quiet_rounds: int = 0  # rounds skipped because nothing had changed

    def poke(self) -> None:
        self.wake.set()

    def nothing_pending(self) -> bool:
        """Nothing that time alone changes: every replica answered with a listing its engine
        can revalidate (none changed in place by a create), and no render, create, policy
        push, status write or release waits for a retry."""
        return (
            bool(self.replicas)
            and all(o.reachable and o.etag is not None for o in self.replicas.values())
            and not any(self.create_errors.values())
            and not any(isinstance(r, RenderFailure) for r in self.renders.values())
            and not self.policy_errors
            and not self.deleting
            and self.statuses_key is not None
            and self.clash is None
        )

    def forget_pool(self, uid: str) -> None:
        """A pool released everywhere: nothing about it is worth keeping, except that it is
        going (`deleting`, dropped once the object is gone): a round that read the cluster
        before the delete must not create it again."""
        self.renders.pop(uid, None)
        self.create_errors.pop(uid, None)
        self.refused.pop(uid, None)
        self.written.forget(uid)


class WriteMemo:
    """The status each object has after our last write, keyed by uid, with the
    resourceVersion the watch showed when we wrote. While the watch still shows that version
    (it lags behind our writes, far behind when a thousand pools change at once), that status
    is the object's: the next round diffs against it and writes nothing new. Once a newer
    version arrives (ours or anybody's), what the object says is the reference again, so an
    overwrite by someone else is corrected."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[str, dict[str, Any]]] = {}

    def current(
        self, uid: str, resource_version: str, seen: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """The object's status as far as we know: ours if the watch has not caught up."""
        sent = self._sent.get(uid)
        if sent is not None and sent[0] == resource_version:
            return sent[1]
        self._sent.pop(uid, None)
        return dict(seen or {})

    def sent(
        self, uid: str, resource_version: str, base: Mapping[str, Any], patch: dict[str, Any]
    ) -> None:
        """`patch` (a merge patch: None removes a field) was written over `base`."""
        merged = {**base, **patch}
        self._sent[uid] = (resource_version, {k: v for k, v in merged.items() if v is not None})

    def forget(self, uid: str) -> None:
        self._sent.pop(uid, None)


class Fleet:
    """All engines this operator process serves, and the pools released by it (so that a
    parent waiting for its children learns at once that they are gone from the engines)."""

    def __init__(self) -> None:
        self.engines: dict[EngineKey, EngineState] = {}
        self.released: set[str] = set()  # pool uids released everywhere
        self._changed: asyncio.Condition | None = None
        self._changes: dict[str, int] = {}  # namespace -> events indexed there

    def touch(self, namespace: str) -> None:
        """An object an engine round reads changed in `namespace` (counted, not kept)."""
        self._changes[namespace] = self._changes.get(namespace, 0) + 1

    def changes(self, namespace: str) -> int:
        return self._changes.get(namespace, 0)

    def changed(self) -> asyncio.Condition:
        """Notified whenever a pool has been released (created lazily: it binds to the loop)."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def mark_released(self, uid: str, alive: set[str]) -> None:
        """`uid` is off every replica; `alive`: uids still in the cluster (older ones go)."""
        self.released &= alive
        self.released.add(uid)
        cond = self.changed()
        async with cond:
            cond.notify_all()

    def poke_namespace(self, namespace: str) -> None:
        for (ns, _), state in self.engines.items():
            if ns == namespace:
                state.poke()

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
