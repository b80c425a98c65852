"""The engine timer's use case: one round for one engine fleet. Poll every replica once,
bring each one to the declared tree (parents first), push admission policies, set each
pod's readiness gate, then compute the engine's status.

The round is the only code that creates pools on engines or sets their policies; the pool
finalizer (pool_release.py) is the only code that releases them. Both hold the engine's
lock. A pod event between rounds may only drop a gate (`drop_stale_gate`), never raise one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from polykv_api import models as wire

from . import gates, manifests, metrics
from . import status as stat
from .api import PolyKVEngineSpec
from .engine_client import EngineClient, EngineRejected, EngineUnreachable
from .faults import crash_point
from .fleet import (
    CreateError,
    EngineState,
    Observation,
    Render,
    RenderFailure,
    ReplicaRef,
    Synced,
)
from .policies import PolicyNode, engine_policy, same_policy, select
from .tree import PoolNode, PoolRequest, Problem, by_name, check, parents_first, request_body

log = logging.getLogger("polykv.operator.engine_round")

GateWriter = Callable[[str, gates.GateWant], Awaitable[None]]  # (pod name, wanted)


@dataclass(frozen=True)
class ClusterView:
    """Everything a round needs from the cluster, taken from the operator's indexes."""

    namespace: str
    name: str
    spec: PolyKVEngineSpec
    pods: Sequence[ReplicaRef]
    pools: Sequence[PoolNode]  # every pool of the namespace (parents may be elsewhere)
    policies: Sequence[PolicyNode]
    engines: Sequence[str]  # engine names of the namespace


@dataclass(frozen=True)
class Desired:
    """A pool this engine should hold, checked and rendered."""

    node: PoolNode
    parent: str | None
    request: PoolRequest
    render: Render


def client_for(
    http: httpx.AsyncClient, view: ClusterView, state: EngineState, pod: ReplicaRef
) -> EngineClient:
    return EngineClient(http, f"http://{pod.ip}:{view.spec.port}", state.admin_key)


async def poll(client: EngineClient, pod: ReplicaRef) -> Observation:
    """One `GET /polykv/pools`: the pools with their live figures and capacity summaries."""
    t0 = time.monotonic()
    try:
        listing = await client.list_pools()
    except (EngineUnreachable, EngineRejected) as exc:
        metrics.POLLS.labels(result="unreachable").observe(time.monotonic() - t0)
        return Observation(pod.name, pod.uid, pod.ip, reachable=False, error=str(exc))
    metrics.POLLS.labels(result="ok").observe(time.monotonic() - t0)
    return Observation(pod.name, pod.uid, pod.ip, reachable=True, listing=listing)


def rejected_reason(exc: EngineRejected, pod: str, name: str) -> RenderFailure:
    """A refused prefix: a condition reason chosen by the engine's reason code (never by its
    wording), and a message that adds the fix a person can apply."""
    msg = exc.message
    match exc.reason:
        case "prefix_too_long":
            fix = "raise the engine's spec.contextSize or shorten the prefix"
            return RenderFailure("PrefixTooLong", f"{msg}; {fix}")
        case "name_conflict":
            return RenderFailure(
                "NameConflict",
                f"replica {pod}: {msg}. It was created outside this resource: release it on "
                f"the engine (DELETE /polykv/pools/{name}) or give this PolyKVPool another name",
            )
        case "no_common_prefix":
            return RenderFailure("NoCommonPrefix", f"{msg} (drop spec.parent)")
        case "branch_pos_invalid" | "prefix_mismatch":
            # prefix_mismatch on a fork: the tokens before the given branchPos differ from
            # the parent's (without a branchPos the engine computes one that fits).
            return RenderFailure("BranchPosInvalid", f"{msg}; lower spec.branchPos or omit it")
        case "seq_ids_exhausted":
            return RenderFailure(
                "EngineFull", f"replica {pod}: {msg}; raise the engine's spec.maxPools"
            )
        case _:
            return RenderFailure("PrefixRejected", f"the engine refused the prefix: {msg}")


class Round:
    """One pass over one engine. Construct, then `await run()`."""

    def __init__(
        self,
        view: ClusterView,
        state: EngineState,
        http: httpx.AsyncClient,
        write_gate: GateWriter,
    ) -> None:
        self.view = view
        self.state = state
        self.http = http
        self.write_gate = write_gate
        self.pools = by_name(view.pools)
        self.mine = [n for n in view.pools if n.engine == view.name]
        self.clients: dict[str, EngineClient] = {}
        self.pods = {p.name: p for p in view.pods if not p.terminating}
        self.changed: set[str] = set()  # pods we mutated this round
        self.desired: list[Desired] = []

    # -- the round ------------------------------------------------------------------

    async def run(self) -> None:
        st = self.state
        st.rounds += 1
        st.pods = dict(self.pods)
        serving = [p for p in self.pods.values() if p.ready and p.ip]
        self.clients = {p.name: client_for(self.http, self.view, st, p) for p in serving}
        await self._poll_all(serving)
        await self._gates(final=False)
        async with st.lock:
            await self._converge()
        if self.changed:
            await self._poll_all([self.pods[n] for n in self.changed])
        await self._gates(final=True)
        # The fleet's figure, for the engine's status and the floor-pressure metric.
        st.mean_active_tps = stat.mean_active_tps(
            lst
            for n, o in st.replicas.items()
            if n in self.clients and o.reachable and (lst := o.listing) is not None
        )

    async def _poll_all(self, pods: Sequence[ReplicaRef]) -> None:
        found = await asyncio.gather(*(poll(self.clients[p.name], p) for p in pods))
        alive = set(self.pods)
        self.state.replicas = {k: v for k, v in self.state.replicas.items() if k in alive}
        for obs in found:
            self.state.replicas[obs.pod] = obs

    # -- validation and materialization ------------------------------------------------

    async def _converge(self) -> None:
        ok: dict[str, Render] = {}
        for node in parents_first(self.mine, self.pools):
            if node.deleting or node.uid in self.state.deleting:
                continue
            found = check(node, self.pools, self.view.engines)
            if isinstance(found, Problem):
                continue
            parent = found[-2] if len(found) > 1 else None
            if parent is not None and parent.name not in ok:
                continue  # the parent is not on the engines (yet): its status says why
            render = await self._render(node, found, ok.get(parent.name) if parent else None)
            if render is None:
                continue
            ok[node.name] = render
            want = Desired(node, parent.name if parent else None, request_body(found), render)
            self.desired.append(want)
            await self._materialize(want)
        await self._push_policies()

    async def _render(
        self, node: PoolNode, found: list[PoolNode], parent_render: Render | None
    ) -> Render | None:
        known = self.state.renders.get(node.uid)
        if isinstance(known, Render):
            return known
        if isinstance(known, RenderFailure) and not known.expired():
            return None
        bp = node.spec.branch_pos
        if bp is not None and parent_render is not None and bp > parent_render.prefix_len:
            self.state.renders[node.uid] = RenderFailure(
                "BranchPosOutOfRange",
                f'branchPos {bp} is beyond the end of parent "{node.parent}" '
                f"({parent_render.prefix_len} tokens); give at most {parent_render.prefix_len}, "
                "or omit branchPos to have the operator compute it",
            )
            return None
        parent = node.parent
        for obs in self._reachable():
            if parent is not None and obs.pool(parent) is None:
                continue
            try:
                res = await self.clients[obs.pod].create(parent, request_body(found, dry_run=True))
            except EngineUnreachable as exc:
                obs.reachable, obs.error = False, str(exc)
                continue
            except EngineRejected as exc:
                failure = rejected_reason(exc, obs.pod, node.name)
                self.state.renders[node.uid] = failure
                log.warning(
                    "pool rejected ns=%s pool=%s reason=%s message=%s",
                    node.namespace,
                    node.name,
                    failure.reason,
                    failure.message,
                )
                return None
            render = Render(res.prefix_len, res.branch_pos, res.prefix_hash)
            self.state.renders[node.uid] = render
            return render
        return None  # no replica can answer yet

    def _reachable(self) -> list[Observation]:
        return [
            o for n, o in sorted(self.state.replicas.items()) if o.reachable and n in self.clients
        ]

    async def _materialize(self, want: Desired) -> None:
        missing = [
            o
            for o in self._reachable()
            if o.pool(want.node.name) is None
            and (want.parent is None or o.pool(want.parent) is not None)
        ]
        if missing:
            await asyncio.gather(*(self._create(o, want) for o in missing))

    async def _create(self, obs: Observation, want: Desired) -> None:
        node = want.node
        errors = self.state.create_errors.setdefault(node.uid, {})
        if node.uid in self.state.deleting:
            return
        try:
            res = await self.clients[obs.pod].create(want.parent, want.request)
        except EngineUnreachable as exc:
            obs.reachable, obs.error = False, str(exc)
            errors[obs.pod] = CreateError(f"no answer: {exc}")
            return
        except EngineRejected as exc:
            errors[obs.pod] = CreateError(exc.message, capacity=exc.reason == "seq_ids_exhausted")
            log.warning(
                "pool create failed ns=%s pool=%s pod=%s status=%s message=%s",
                node.namespace,
                node.name,
                obs.pod,
                exc.status,
                exc.message,
            )
            return
        errors.pop(obs.pod, None)
        self.changed.add(obs.pod)
        crash_point("pool-created")  # created on the engine, not yet in any status
        if res.pool is not None and obs.listing is not None:
            obs.listing.pools.append(res.pool)  # children in this round see their parent
        log.info(
            "pool materialized ns=%s pool=%s pod=%s pool_id=%s created=%s len=%d d=%d",
            node.namespace,
            node.name,
            obs.pod,
            res.pool_id,
            res.created,
            res.prefix_len,
            res.branch_pos,
        )

    async def _push_policies(self) -> None:
        labels = {n.name: dict(n.labels) for n in self.view.pools}
        selection = select(self.view.policies, labels)
        self.state.policy_errors.clear()
        jobs = []
        for want in self.desired:
            name = want.node.name
            if name in selection.conflicts:
                continue  # reported on the policies; the engine keeps what it has
            policy = selection.applied.get(name)
            target = engine_policy(policy.spec) if policy is not None else None
            for obs in self._reachable():
                current = obs.pool(name)
                if current is None or same_policy(current.admission, target):
                    continue
                jobs.append(self._set_policy(obs, name, target))
        await asyncio.gather(*jobs)

    async def _set_policy(
        self, obs: Observation, name: str, target: wire.AdmissionPolicy | None
    ) -> None:
        client = self.clients[obs.pod]
        try:
            if target is None:
                await client.clear_admission(name)
            else:
                await client.set_admission(name, target)
        except EngineUnreachable as exc:
            obs.reachable, obs.error = False, str(exc)
            return
        except EngineRejected as exc:
            self.state.policy_errors[name] = f"replica {obs.pod}: {exc.message}"
            return
        self.changed.add(obs.pod)
        log.info(
            "admission policy pushed ns=%s pool=%s pod=%s cleared=%s",
            self.view.namespace,
            name,
            obs.pod,
            target is None,
        )

    # -- readiness gates ------------------------------------------------------------------

    def complete(self, obs: Observation | None) -> bool:
        """Every rendered declared pool and its policy are on this replica."""
        if obs is None or not obs.reachable:
            return False
        labels = {n.name: dict(n.labels) for n in self.view.pools}
        selection = select(self.view.policies, labels)
        for name, render in self._rendered().items():
            pool = obs.pool(name)
            if pool is None or pool.prefix_hash != render.prefix_hash:
                return False
            if name in selection.conflicts:
                continue
            policy = selection.applied.get(name)
            target = engine_policy(policy.spec) if policy is not None else None
            if not same_policy(pool.admission, target):
                return False
        return True

    def _rendered(self) -> dict[str, Render]:
        out: dict[str, Render] = {}
        for node in self.mine:
            r = self.state.renders.get(node.uid)
            if isinstance(r, Render) and not node.deleting and node.uid not in self.state.deleting:
                out[node.name] = r
        return out

    async def _gates(self, final: bool) -> None:
        """Before converging (final=False) gates only drop; afterwards they may rise."""
        n_pools = len(self._rendered())
        for pod in list(self.pods.values()):
            obs = self.state.replicas.get(pod.name)
            synced = self.state.synced.get(pod.uid)
            complete = self.complete(obs)
            want = gates.decide(pod, obs, synced, complete, n_pools)
            if want is not None and not want.status:
                self.state.synced.pop(pod.uid, None)
            news = want is not None and (want.status != (pod.gate == "True") or pod.gate is None)
            if want is not None and news and (final or not want.status):
                await self._write_gate(pod, want)
            serving = want is None or want.status
            if final and complete and serving and obs is not None and obs.boot_id is not None:
                self.state.synced[pod.uid] = Synced(obs.boot_id, pod.restarts)

    async def _write_gate(self, pod: ReplicaRef, want: gates.GateWant) -> None:
        await self.write_gate(pod.name, want)
        log.info(
            "readiness gate ns=%s pod=%s ready=%s reason=%s",
            self.view.namespace,
            pod.name,
            want.status,
            want.reason,
        )
        pod = replace(pod, gate="True" if want.status else "False")
        self.pods[pod.name] = pod
        self.state.pods[pod.name] = pod


# -- the use cases ------------------------------------------------------------------------


async def run_round(
    view: ClusterView,
    state: EngineState,
    http: httpx.AsyncClient,
    write_gate: GateWriter,
    generation: int,
    status: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One round, then the engine's status: the merge patch for it ({} when unchanged)."""
    try:
        await Round(view, state, http, write_gate).run()
        metrics.ROUNDS.labels("ok").inc()
    except Exception:
        metrics.ROUNDS.labels("error").inc()
        raise
    new = stat.engine_status(
        view.spec,
        view.name,
        generation,
        state,
        [n for n in view.pools if n.engine == view.name],
        stat.previous_conditions(status),
        manifests.selector_string(view.name),
    )
    return stat.patch_for(status, new)


async def drop_stale_gate(
    state: EngineState, pod: ReplicaRef, write_gate: GateWriter
) -> gates.GateWant | None:
    """On a pod event: an engine that stopped or restarted has lost its KV, so its gate
    drops now rather than at the next round (which raises it again once the tree is back)."""
    want = gates.must_drop(pod, state.synced.get(pod.uid))
    if want is None:
        return None
    state.synced.pop(pod.uid, None)
    await write_gate(pod.name, want)
    log.info("readiness gate dropped ns=%s pod=%s reason=%s", state.key[0], pod.name, want.reason)
    return want
