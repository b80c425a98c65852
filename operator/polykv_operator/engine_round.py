"""One round for one engine fleet: poll every replica once, bring each one to the declared
tree (parents first), push admission policies, set each pod's readiness gate and its
deletion cost. The loop that schedules rounds and writes the statuses is engine_loop.py.

The round is the only code that creates pools on engines or sets their policies; the pool
finalizer (pool_release.py) is the only code that releases them. Both hold the engine's
lock. A pod event between rounds may only drop a gate (`drop_stale_gate`), never raise one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import httpx

from polykv_api import models as wire

from . import gates, metrics
from . import status as stat
from .api import PolyKVEngineSpec
from .autoscale import deletion_cost
from .engine_client import EngineClient, EngineRejected, EngineUnreachable
from .faults import crash_point
from .fleet import (
    BUSY,
    FULL,
    CreateError,
    EngineState,
    Observation,
    Render,
    RenderFailure,
    ReplicaRef,
    Synced,
    boot_named,
)
from .names import http_url
from .policies import PolicyNode, engine_policy, same_policy, select
from .tree import PoolNode, PoolRequest, Problem, by_name, check, parents_first, request_body

log = logging.getLogger("polykv.operator.engine_round")

GateWriter = Callable[[str, gates.GateWant], Awaitable[None]]  # (pod name, wanted)
CostWriter = Callable[[str, str], Awaitable[None]]  # (pod name, pod-deletion-cost)


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
    http: httpx.AsyncClient, port: int, state: EngineState, pod: ReplicaRef
) -> EngineClient:
    if pod.ip is None:
        raise ValueError(f"replica {pod.name} has no address yet")
    return EngineClient(http, http_url(pod.ip, port), state.admin_key)


async def poll(client: EngineClient, pod: ReplicaRef, held: Observation | None) -> Observation:
    """One `GET /polykv/pools`: the pools with their live figures and capacity summaries.
    With `held`, the same replica's last observation, the listing is revalidated by its
    ETag: unchanged, it is kept as it is (the same object) and nothing is parsed."""
    same = (
        held is not None
        and held.uid == pod.uid
        and held.ip == pod.ip
        and held.listing is not None
        and held.etag is not None
    )
    t0 = time.monotonic()
    try:
        got = await client.list_pools(held.etag if same and held is not None else None)
    except (EngineUnreachable, EngineRejected) as exc:
        metrics.POLLS.labels(result="unreachable").observe(time.monotonic() - t0)
        return Observation(pod.name, pod.uid, pod.ip, reachable=False, error=str(exc))
    if got.listing is None and same and held is not None:
        metrics.POLLS.labels(result="unchanged").observe(time.monotonic() - t0)
        listing = held.listing
    else:
        metrics.POLLS.labels(result="ok").observe(time.monotonic() - t0)
        listing = got.listing
    return Observation(pod.name, pod.uid, pod.ip, reachable=True, listing=listing, etag=got.etag)


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
        case "recurrent_branch":
            return RenderFailure(
                "RecurrentBranch",
                f"{msg}; on this engine's model a child pool extends its parent: start its "
                "prefix with the parent's whole prefix (and omit spec.branchPos), or make it "
                "a root pool (drop spec.parent)",
            )
        case "seq_ids_exhausted":
            return RenderFailure(
                "EngineFull", f"replica {pod}: {msg}; raise the engine's spec.maxPools"
            )
        case "pools_disabled":
            return RenderFailure(
                "PoolsDisabled",
                f"replica {pod}: {msg}; this engine serves no pools (check its spec.extraArgs "
                "and its model)",
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
        write_cost: CostWriter | None = None,
    ) -> None:
        self.view = view
        self.state = state
        self.http = http
        self.write_gate = write_gate
        self.write_cost = write_cost
        self.pools = by_name(view.pools)
        self.mine = [n for n in view.pools if n.engine == view.name]
        self.clients: dict[str, EngineClient] = {}
        self.pods = {p.name: p for p in view.pods if not p.terminating}
        self.changed: set[str] = set()  # pods we mutated this round
        self.desired: list[Desired] = []
        labels = {n.name: dict(n.labels) for n in view.pools}
        self.selection = select(view.policies, labels)

    # -- the round ------------------------------------------------------------------

    async def run(self) -> None:
        st = self.state
        st.rounds += 1
        st.pods = dict(self.pods)
        st.deleting &= {n.uid for n in self.view.pools}  # gone from the cluster: forgotten
        serving = [p for p in self.pods.values() if p.ready and p.ip]
        port = self.view.spec.port
        self.clients = {p.name: client_for(self.http, port, st, p) for p in serving}
        await self._poll_all(serving)
        crash_point("polled")  # replicas polled, nothing changed yet
        await self._gates(final=False)
        async with st.lock:
            await self._converge()
        # No re-poll: every create and policy push answered with the pool as it now is on
        # that replica (Observation.add_pool), so the listings are current.
        await self._gates(final=True)
        if self.write_cost is not None:
            await self._deletion_costs(self.write_cost)
        # The fleet's figures, for the engine's status and the metrics.
        listings = [
            lst
            for n, o in st.replicas.items()
            if n in self.clients and o.reachable and (lst := o.listing) is not None
        ]
        st.mean_active_tps = stat.mean_active_tps(listings)
        declared = {n.name for n in self.mine}
        theirs = [  # a tenant's kept prefixes are the engine's cache, nobody's pools
            p
            for lst in listings
            for p in lst.pools
            if p.name not in declared and p.kept_until is None
        ]
        st.unmanaged_pools = len(theirs)
        st.orphaned_pins = sum(1 for p in theirs if p.orphaned_pin)

    async def _poll_all(self, pods: Sequence[ReplicaRef]) -> None:
        held = self.state.replicas
        found = await asyncio.gather(
            *(poll(self.clients[p.name], p, held.get(p.name)) for p in pods)
        )
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
                if exc.reason in BUSY:
                    continue  # busy (KV or queue full): no verdict on the prefix
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
            crash_point("rendered")  # dry run answered, nothing created
            return render
        return None  # no replica can answer yet

    def _reachable(self) -> list[Observation]:
        return [
            o for n, o in sorted(self.state.replicas.items()) if o.reachable and n in self.clients
        ]

    async def _materialize(self, want: Desired) -> None:
        errors = self.state.create_errors.get(want.node.uid, {})
        missing = [
            o
            for o in self._reachable()
            if o.pool(want.node.name) is None
            and (want.parent is None or o.pool(want.parent) is not None)
            and (o.pod not in errors or errors[o.pod].retry_due())
        ]
        if missing:
            await asyncio.gather(*(self._create(o, want) for o in missing))

    async def _create(self, obs: Observation, want: Desired) -> None:
        node = want.node
        errors = self.state.create_errors.setdefault(node.uid, {})
        if node.uid in self.state.deleting:
            return
        client = self.clients[obs.pod]
        request = want.request
        peer = self._peer_for(obs, node.name)
        if peer is not None:
            request = request.model_copy(update={"restore_peer": peer})
        try:
            try:
                res = await client.create(want.parent, request)
            except EngineRejected as exc:
                # A tree larger than the replica's pool sequence ids: a cold pool makes room
                # (the engine keeps it, and re-materializes it on its next attach or fork).
                if exc.reason != FULL or not await self._evict_one(obs, want):
                    raise
                res = await client.create(want.parent, request)
        except EngineUnreachable as exc:
            obs.reachable, obs.error = False, str(exc)
            errors[obs.pod] = CreateError(f"no answer: {exc}")
            return
        except EngineRejected as exc:
            errors[obs.pod] = CreateError(exc.message, exc.reason)
            log.warning(
                "pool create failed ns=%s pool=%s pod=%s status=%s reason=%s message=%s",
                node.namespace,
                node.name,
                obs.pod,
                exc.status,
                exc.reason,
                exc.message,
            )
            return
        errors.pop(obs.pod, None)
        self.changed.add(obs.pod)
        crash_point("pool-created")  # created on the engine, not yet in any status
        if res.pool is not None:
            obs.add_pool(res.pool)  # children in this round see their parent
        restore = res.restore
        log.info(
            "pool materialized ns=%s pool=%s pod=%s pool_id=%s created=%s len=%d d=%d "
            "source=%s refused=%s seconds=%s",
            node.namespace,
            node.name,
            obs.pod,
            res.pool_id,
            res.created,
            res.prefix_len,
            res.branch_pos,
            restore.source if restore else None,
            restore.refused if restore else None,
            f"{restore.seconds:.3f}" if restore else None,
        )

    def _peer_for(self, obs: Observation, name: str) -> str | None:
        """Another replica holding pool `name` in its cache, for `obs`'s replica to fetch its
        snapshot from when its own store has none (one whose gate is up first)."""
        snaps = self.view.spec.snapshots
        if not (snaps.enabled and snaps.from_peers):
            return None
        found = []
        for other in self._reachable():
            pool = other.pool(name)
            pod = self.pods.get(other.pod)
            if other.pod == obs.pod or pool is None or pool.residency != "resident":
                continue
            if pod is not None and pod.ip:
                found.append((pod.gate != "True", pod.name, pod.ip))
        if not found:
            return None
        return http_url(min(found)[2], self.view.spec.port)

    async def _evict_one(self, obs: Observation, want: Desired) -> bool:
        """Evicts the coldest declared pool of this replica that nobody uses (not pinned, no
        sessions, no resident child, not an ancestor of `want`). False: none can go."""
        if obs.listing is None:
            return False
        keep = set()
        parent = want.parent
        while parent is not None:
            keep.add(parent)
            node = self.pools.get(parent)
            parent = node.parent if node is not None else None
        declared = {n.name for n in self.mine}
        resident_parents = {
            p.parent for p in obs.listing.pools if p.residency != "evicted" and p.parent is not None
        }
        cold = sorted(
            (
                p
                for p in obs.listing.pools
                if p.name in declared
                and p.name not in keep
                and p.residency == "resident"
                and not p.pinned
                and not p.sessions
                and p.pool_id not in resident_parents
            ),
            key=lambda p: p.last_access_ts,
        )
        for victim in cold:
            assert victim.name is not None
            try:
                evicted = await self.clients[obs.pod].evict(victim.name)
            except EngineRejected:
                continue  # in use since the poll: the next one
            obs.add_pool(evicted)
            crash_point("pool-evicted")
            log.info(
                "pool evicted to make room ns=%s pool=%s pod=%s for=%s",
                self.view.namespace,
                victim.name,
                obs.pod,
                want.node.name,
            )
            return True
        return False

    async def _push_policies(self) -> None:
        selection = self.selection
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
                now = await client.clear_admission(name)
            else:
                now = await client.set_admission(name, target)
        except EngineUnreachable as exc:
            obs.reachable, obs.error = False, str(exc)
            return
        except EngineRejected as exc:
            self.state.policy_errors[name] = f"replica {obs.pod}: {exc.message}"
            return
        obs.add_pool(now)
        self.changed.add(obs.pod)
        crash_point("policy-pushed")
        log.info(
            "admission policy pushed ns=%s pool=%s pod=%s cleared=%s",
            self.view.namespace,
            name,
            obs.pod,
            target is None,
        )

    # -- readiness gates ------------------------------------------------------------------

    def complete(self, obs: Observation | None) -> bool:
        """Every rendered declared pool and its policy are on this replica, except pools
        that cannot fit on it (refused for capacity): the gate does not wait for those."""
        if obs is None or not obs.reachable:
            return False
        selection = self.selection
        for name, (uid, render) in self._rendered().items():
            pool = obs.pool(name)
            if pool is None:
                err = self.state.create_errors.get(uid, {}).get(obs.pod)
                if err is not None and err.capacity:
                    continue
                return False
            if pool.prefix_hash != render.prefix_hash:
                return False
            if name in selection.conflicts:
                continue
            policy = selection.applied.get(name)
            target = engine_policy(policy.spec) if policy is not None else None
            if not same_policy(pool.admission, target):
                return False
        return True

    def _rendered(self) -> dict[str, tuple[str, Render]]:
        """Declared pools with a render: name -> (uid, render)."""
        out: dict[str, tuple[str, Render]] = {}
        for node in self.mine:
            r = self.state.renders.get(node.uid)
            if isinstance(r, Render) and not node.deleting and node.uid not in self.state.deleting:
                out[node.name] = (node.uid, r)
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
        crash_point("gate-written")
        log.info(
            "readiness gate ns=%s pod=%s ready=%s reason=%s",
            self.view.namespace,
            pod.name,
            want.status,
            want.reason,
        )
        boot = boot_named(want.message) if want.status else None
        pod = replace(pod, gate="True" if want.status else "False", gate_boot=boot)
        self.pods[pod.name] = pod
        self.state.pods[pod.name] = pod

    # -- pod deletion cost ----------------------------------------------------------------

    async def _deletion_costs(self, write: CostWriter) -> None:
        """Each pod's pod-deletion-cost: the sessions its replica holds (written when it
        changed), so that a scale-down removes the replica with the fewest."""
        st = self.state
        alive = {p.uid for p in self.pods.values()}
        st.costs_sent = {uid: v for uid, v in st.costs_sent.items() if uid in alive}
        todo = deletion_cost.wanted(self.pods, st.replicas, st.costs_sent)

        async def one(name: str, value: str) -> None:
            pod = self.pods[name]
            try:
                await write(name, value)
            except Exception as exc:  # the next round tries again
                log.warning(
                    "deletion cost write failed ns=%s pod=%s: %s", self.view.namespace, name, exc
                )
                return
            deletion_cost.record(st.costs_sent, pod, value)
            log.debug("deletion cost ns=%s pod=%s cost=%s", self.view.namespace, name, value)

        await asyncio.gather(*(one(n, v) for n, v in sorted(todo.items())))


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
    crash_point("gate-written")
    log.info("readiness gate dropped ns=%s pod=%s reason=%s", state.key[0], pod.name, want.reason)
    return want
