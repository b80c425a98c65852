"""Releasing a deleted pool on every replica of its engine (the finalizer's work).

A replica that does not answer keeps the pool, and so keeps the finalizer: the pool may
still be serving sessions there, and forgetting it would leak its KV. A replica that is
gone, or whose engine is not running, holds nothing to release.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from .engine_client import EngineClient, EngineRejected, EngineUnreachable
from .faults import crash_point
from .fleet import EngineState, ReplicaRef

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


async def release_everywhere(
    state: EngineState,
    pods: list[ReplicaRef],
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
