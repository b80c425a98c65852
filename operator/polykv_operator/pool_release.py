"""The pool finalizer's use case: children first, then release the pool on every replica
of its engine, and say in the pool's status what it waits for meanwhile.

Deleting a tree takes one step per level, not retry back-off: a parent deletes its children,
then waits (in the handler, bounded by `CHILDREN_WAIT_S`) to be told that they are off the
engines (`Fleet.mark_released`), and goes on at once.

A replica that does not answer keeps the pool, and so keeps the finalizer: the pool may
still be serving sessions there, and forgetting it would leak its KV. A replica that is
gone, or whose engine is not running, holds nothing to release. A replica that keeps
refusing (agent-made forks under the pool, say) turns the pool `Stalled` with its reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from . import status as stat
from .conditions import Verdict, conditions_for
from .engine_client import EngineClient, EngineRejected, EngineUnreachable
from .faults import crash_point
from .fleet import EngineState, Fleet, ReplicaRef
from .kube import Kube
from .names import http_url
from .tree import PoolNode, children_of

log = logging.getLogger("polykv.operator.pool_release")

CHILDREN_WAIT_S = 20.0  # a parent waits this long in one go for its children to be released
STALL_AFTER = 3  # refused releases in a row before the pool turns Stalled
REFUSED_RETRY_S = 3.0


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
    pools: Callable[[], Sequence[PoolNode]],
    holder: Holder | None,
    http: httpx.AsyncClient,
    kube: Kube,
    status: Mapping[str, Any] | None,
    fleet: Fleet,
    children_wait_s: float = CHILDREN_WAIT_S,
) -> Waiting | None:
    """Children first (deleted here, whatever the propagation policy, then awaited), then
    this pool on every replica of `holder`. `pools()` reads the live index. None: released
    everywhere, the finalizer may go."""

    def remaining() -> list[PoolNode]:
        return [c for c in children_of(name, pools()) if c.uid not in fleet.released]

    children = remaining()
    if children:
        for child in children:
            if not child.deleting:
                await kube.delete_pool(namespace, child.name)
        crash_point("children-deleted")
        cond = fleet.changed()
        try:
            async with cond:
                await asyncio.wait_for(cond.wait_for(lambda: not remaining()), children_wait_s)
        except TimeoutError:
            children = remaining()
            names = ", ".join(c.name for c in children)
            verdict = Verdict.reconciling("DeletingChildren", f"child pools go first: {names}")
            return Waiting(
                f"waiting for child pools to be deleted: {names}", 1, _conditions(status, verdict)
            )
    alive = {n.uid for n in pools()}
    if holder is None:
        await fleet.mark_released(uid, alive)
        return None  # no engine, no replicas: nothing holds the pool
    state = holder.state
    state.deleting.add(uid)
    out = await release_everywhere(state, holder.pods, http, holder.port, name)
    if out.done:
        state.forget_pool(uid)
        crash_point("pool-forgotten")  # off every replica; the finalizer is still on
        await fleet.mark_released(uid, alive)
        state.poke()  # the engine's status counts its pools again
        return None
    if out.unreachable:
        pod, err = sorted(out.unreachable.items())[0]
        verdict = Verdict.unknown(
            "EngineUnreachable",
            f"replica {pod} does not answer ({err}); the pool stays (and this finalizer) "
            "until it can be released there",
        )
        state.refused.pop(uid, None)
    else:
        pod, err = sorted(out.blocked.items())[0]
        refused = state.refused[uid] = state.refused.get(uid, 0) + 1
        message = f"replica {pod} refused to release it: {err}"
        if refused < STALL_AFTER:
            verdict = Verdict.reconciling("ReleaseRefused", message)
        else:
            verdict = Verdict.stalled(
                "ReleaseRefused",
                f"{message} (refused {refused} times in a row). Release what holds it on the "
                "engine (agent-made child pools, pins), or, to give up on the engine side, "
                "remove the finalizer by hand: kubectl patch polykvpool/"
                f'{name} --type=json -p \'[{{"op":"remove","path":"/metadata/finalizers"}}]\'',
            )
        return Waiting(
            verdict.message, REFUSED_RETRY_S * min(refused, 10), _conditions(status, verdict)
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
        assert pod.ip is not None  # holders have an address
        client = EngineClient(http, http_url(pod.ip, port), state.admin_key)
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
        if obs is not None:
            obs.drop_pool(name)
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
