"""The engine's loop: rounds for one engine for as long as it exists, and the statuses they
lead to. `serve` runs a round (engine_round.py) at once when something is poked (a pool
applied, a replica ready, a policy edited; pokes during a round coalesce into one more
round), else every interval as a safety net. One loop per engine, no per-pool timer. At the
interval a settled engine is first asked whether anything changed (`quiet`: the
namespace's change count, and each replica's listing revalidated by its ETag); a round runs
only if so, so an idle operator costs the same with 10 pools or 1,000. After each round the
engine's status and its pools' statuses are written, each only when it changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from opentelemetry import trace

from . import manifests, metrics
from . import status as stat
from .api import ENGINE, POOL
from .engine_round import ClusterView, CostWriter, GateWriter, Round, client_for, poll
from .faults import crash_point
from .fleet import EngineState, Fleet, Settled
from .policies import select
from .tree import PoolNode, by_name

log = logging.getLogger("polykv.operator.engine_loop")
TRACER = trace.get_tracer("polykv.operator")  # spans only when polykv_api.tracing set it up

# (plural, object name, status merge patch); an object gone meanwhile is not an error.
StatusWriter = Callable[[str, str, dict[str, Any]], Awaitable[None]]

FULL_ROUND_S = 300.0  # an idle engine still gets a full round this often (a safety net)
COALESCE_S = 0.05  # after a poke, wait this long for the rest of a `kubectl apply` burst
WRITE_CONCURRENCY = 16  # status writes in flight at once (one API server, many pools)


@dataclass(frozen=True)
class Snapshot:
    """The engine and its namespace as the operator's indexes show them now."""

    view: ClusterView
    uid: str
    generation: int
    status: Mapping[str, Any]
    resource_version: str
    changes: int = 0  # the namespace's change count, read before the view (Fleet.changes)


async def run_cycle(
    snap: Snapshot,
    state: EngineState,
    fleet: Fleet,
    http: httpx.AsyncClient,
    write_gate: GateWriter,
    write_status: StatusWriter,
    write_cost: CostWriter | None = None,
) -> None:
    """One round, then the engine's status and its pools' statuses, each written only when
    it changed (and not again while the watch has not yet shown our last write)."""
    view = snap.view
    state.settled = None
    current = state.written.current(snap.uid, snap.resource_version, snap.status)
    try:
        await Round(view, state, http, write_gate, write_cost).run()
        metrics.ROUNDS.labels("ok").inc()
    except Exception:
        metrics.ROUNDS.labels("error").inc()
        raise
    new = stat.engine_status(
        view.spec,
        view.name,
        snap.generation,
        state,
        [n for n in view.pools if n.engine == view.name],
        stat.previous_conditions(current),
        manifests.selector_string(view.name),
    )
    patch = stat.patch_for(current, new)
    if patch:
        await write_status(ENGINE.plural, view.name, patch)
        state.written.sent(snap.uid, snap.resource_version, current, patch)
        crash_point("engine-status-written")
    await write_pool_statuses(view, state, fleet, write_status)
    if state.nothing_pending():
        state.settled = Settled(snap.changes, view.spec.port)


async def quiet(state: EngineState, changes: int, http: httpx.AsyncClient) -> bool:
    """True when a round now would do nothing, found without reading the cluster: the last
    round settled, no object of the namespace changed since (`changes`), and every replica
    answers 304 to its listing's ETag. The cost is one small request per replica, however
    many pools there are. A full round still runs every `FULL_ROUND_S`."""
    settled = state.settled
    if (
        settled is None
        or settled.changes != changes
        or time.monotonic() - settled.at > FULL_ROUND_S
    ):
        return False
    held = list(state.replicas.values())
    pods = [state.pods.get(o.pod) for o in held]
    if any(p is None or p.ip is None for p in pods):
        return False
    found = await asyncio.gather(
        *(
            poll(client_for(http, settled.port, state, p), p, o)
            for p, o in zip(pods, held, strict=True)
            if p is not None
        )
    )
    for obs in found:  # a changed listing is kept: the full round revalidates it cheaply
        state.replicas[obs.pod] = obs
    return all(
        new.reachable and new.listing is old.listing for new, old in zip(found, held, strict=True)
    )


async def write_pool_statuses(
    view: ClusterView, state: EngineState, fleet: Fleet, write_status: StatusWriter
) -> int:
    """The status of every live pool of this engine, from the last round (no engine calls);
    returns how many were written. Deleting pools are the finalizer's to write."""
    policies = select(view.policies, {n.name: dict(n.labels) for n in view.pools})
    ctx = stat.PoolContext(
        pools=by_name(view.pools),
        engines=view.engines,
        fleet={e: s for e in view.engines if (s := fleet.peek(view.namespace, e)) is not None},
        selection=policies,
    )
    key = stat.inputs_key(view.pools, view.engines, state, policies)
    if key == state.statuses_key:
        return 0  # nothing they depend on changed since every one of them was written
    limit = asyncio.Semaphore(WRITE_CONCURRENCY)
    written = 0
    failed = False

    async def one(node: PoolNode, current: dict[str, Any], patch: dict[str, Any]) -> None:
        nonlocal written
        async with limit:
            try:
                await write_status(POOL.plural, node.name, patch)
            except Exception as exc:  # the next round tries again
                nonlocal failed
                failed = True
                log.warning(
                    "pool status write failed ns=%s pool=%s: %s", node.namespace, node.name, exc
                )
                return
        state.written.sent(node.uid, node.resource_version, current, patch)
        written += 1
        log.debug(
            "pool status written ns=%s pool=%s rv=%s fields=%s",
            node.namespace,
            node.name,
            node.resource_version,
            sorted(patch),
        )
        crash_point("pool-status-written")

    jobs = []
    for node in view.pools:
        if node.engine != view.name or node.deleting:
            continue
        current = state.written.current(node.uid, node.resource_version, node.status)
        new = stat.pool_status(node, ctx, stat.previous_conditions(current))
        metrics.POOLS.record(
            metrics.PoolFigures(
                node.namespace,
                node.name,
                node.engine,
                {c.type: c.status for c in new.conditions or []},
                bool(new.orphaned_pin),
            )
        )
        patch = stat.patch_for(current, new)
        if patch:
            jobs.append(one(node, current, patch))
    await asyncio.gather(*jobs)
    state.statuses_key = None if failed else key
    return written


async def serve(
    state: EngineState,
    snapshot: Callable[[], Snapshot],
    fleet: Fleet,
    http: httpx.AsyncClient,
    write_gate: GateWriter,
    write_status: StatusWriter,
    interval_s: float,
    stopped: Callable[[], bool],
    write_cost: CostWriter | None = None,
) -> None:
    """Rounds for one engine until `stopped()`: at once when poked (pokes that arrive during
    a round make exactly one more), else every `interval_s`. A failed round is logged and
    retried with back-off; the loop itself never ends on an error."""
    state.poke()  # the first round at once
    failures = 0
    while not stopped():
        wait = interval_s if not failures else min(interval_s * 2**failures, 60.0)
        try:
            await asyncio.wait_for(state.wake.wait(), timeout=wait)
            await asyncio.sleep(COALESCE_S)
        except TimeoutError:
            pass
        if stopped():
            return
        poked = state.wake.is_set()
        state.wake.clear()
        try:
            if not poked and await quiet(state, fleet.changes(state.key[0]), http):
                state.quiet_rounds += 1
                metrics.ROUNDS.labels("quiet").inc()
                continue
            ns, engine = state.key
            attrs = {"k8s.namespace.name": ns, "polykv.engine": engine}
            with TRACER.start_as_current_span("polykv.operator.round", attributes=attrs):
                await run_cycle(
                    snapshot(), state, fleet, http, write_gate, write_status, write_cost
                )
        except Exception:
            failures += 1
            metrics.RECONCILES.labels("engine", "round", "error").inc()
            log.exception("engine round failed ns=%s engine=%s (%d in a row)", *state.key, failures)
            await asyncio.sleep(min(0.5 * 2**failures, 10.0))
            continue
        failures = 0
        state.rounds_done += 1
        metrics.RECONCILES.labels("engine", "round", "ok").inc()
