"""The pool finalizer's use case: children first, then release the pool on every replica
of its engine, and say in the pool's status what it waits for meanwhile.

A replica that does not answer keeps the pool, and so keeps the finalizer: the pool may
still be serving sessions there, and forgetting it would leak its KV. A replica that is
gone, or whose engine is not running, holds nothing to release.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from . import status as stat
from .conditions import Verdict, conditions_for
from .engine_client import EngineClient, EngineRejected, EngineUnreachable
from .faults import crash_point
from .fleet import EngineState, ReplicaRef
from .kube import Kube
from .tree import PoolNode, children_of

log = logging.getLogger("polykv.operator.pool_release")


@dataclass
class Released:
    released: list[str] = field(default_factory=list)  # pods where it was released now
    absent: list[str] = field(default_factory=list)  # pods that did not have it
    blocked: dict[str, str] = field(default_factory=dict)  # pod -> engine's refusal
    unreachable: dict[str, str] = field(default_factory=dict)  # pod -> error

    @property
    def done(self) -> bool:
        return not self.blocked and not self.unreachable


@dataclass(frozen=True)
class Holder:
    """The engine whose replicas may hold the pool."""

    state: EngineState
    pods: Sequence[ReplicaRef]
    port: int


@dataclass(frozen=True)
class Waiting:
    """The pool cannot go yet: `message` for the retry, `status_patch` for its status."""

    message: str
    delay: float
    status_patch: dict[str, Any]


async def finalize_pool(
    namespace: str,
    name: str,
    uid: str,
    pools: Sequence[PoolNode],
    holder: Holder | None,
    http: httpx.AsyncClient,
    kube: Kube,
    status: Mapping[str, Any] | None,
) -> Waiting | None:
    """Children first (deleted here, whatever the propagation policy), then this pool on
    every replica of `holder`. None: released everywhere, the finalizer may go."""
    children = children_of(name, pools)
    if children:
        for child in children:
            if not child.deleting:
                await kube.delete_pool(namespace, child.name)
        names = ", ".join(c.name for c in children)
        verdict = Verdict.reconciling("DeletingChildren", f"child pools go first: {names}")
        return Waiting(
            f"waiting for child pools to be deleted: {names}", 1, _conditions(status, verdict)
        )
    if holder is None:
        return None  # no engine, no replicas: nothing holds the pool
    state = holder.state
    state.deleting.add(uid)
    out = await release_everywhere(state, holder.pods, http, holder.port, name)
    if out.done:
        state.forget_pool(uid)
        return None
    if out.unreachable:
        pod, err = sorted(out.unreachable.items())[0]
        verdict = Verdict.unknown(
            "EngineUnreachable",
            f"replica {pod} does not answer ({err}); the pool stays (and this finalizer) "
            "until it can be released there",
        )
    else:
        pod, err = sorted(out.blocked.items())[0]
        verdict = Verdict.reconciling(
            "ReleaseRefused", f"replica {pod} refused to release it: {err}"
        )
    return Waiting(verdict.message, 3, _conditions(status, verdict))


def _conditions(status: Mapping[str, Any] | None, verdict: Verdict) -> dict[str, Any]:
    """The conditions while the pool is deleting, as a patch ({} when already said)."""
    conds = [c.wire() for c in conditions_for(verdict, stat.previous_conditions(status), None)]
    return {} if (status or {}).get("conditions") == conds else {"conditions": conds}


async def release_everywhere(
    state: EngineState,
    pods: Sequence[ReplicaRef],
    http: httpx.AsyncClient,
    port: int,
    name: str,
) -> Released:
    out = Released()
    holders = [p for p in pods if not p.terminating and p.running and p.ip]

    async def one(pod: ReplicaRef) -> None:
        client = EngineClient(http, f"http://{pod.ip}:{port}", state.admin_key)
        try:
            if await client.release(name):
                out.released.append(pod.name)
                crash_point("pool-released")  # gone from the engine, finalizer still on
            else:
                out.absent.append(pod.name)
        except EngineUnreachable as exc:
            out.unreachable[pod.name] = str(exc)
        except EngineRejected as exc:
            out.blocked[pod.name] = exc.message

    async with state.lock:
        await asyncio.gather(*(one(p) for p in holders))
    for pod in out.released:
        obs = state.replicas.get(pod)
        if obs is not None and obs.listing is not None:
            obs.listing.pools = [p for p in obs.listing.pools if p.name != name]
    log.info(
        "pool release ns=%s engine=%s pool=%s released=%s absent=%s blocked=%s unreachable=%s",
        state.key[0],
        state.key[1],
        name,
        out.released,
        out.absent,
        sorted(out.blocked),
        sorted(out.unreachable),
    )
    return out
