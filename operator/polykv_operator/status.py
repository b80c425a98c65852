"""Status of the three kinds, computed from the indexes and the fleet's last observations.

Pure functions: the handlers pass what they know and write the result only when it differs
from what the object already says (`patch_for`). Figures that jitter (tokens/s, pressure)
are rounded so that an idle tree produces no writes at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from polykv_api import models as wire

from .api import (
    AdmissionPolicyStatus,
    KubeModel,
    PolicyConflict,
    PolyKVEngineSpec,
    PolyKVEngineStatus,
    PolyKVPoolStatus,
    PoolCapacity,
    PoolReplica,
    ReplicaStatus,
    SnapshotTotals,
)
from .api.meta import Condition
from .conditions import Verdict, conditions_for
from .fleet import EngineState, Observation, Render, RenderFailure
from .policies import PolicyNode, Selection, engine_policy, same_policy
from .tree import PoolNode, Problem, check, path_of

RESTORED = ("store", "peer")  # materialized_from values of a pool restored from a snapshot
NAME_CLASH = "NameClash"  # an object the engine would own is held by somebody else
STUCK_WAITING = (
    "CrashLoopBackOff",
    "RunContainerError",
    "CreateContainerConfigError",
    "CreateContainerError",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
)


def mean_active_tps(counts: Iterable[wire.PoolStatus | wire.PoolList]) -> float | None:
    """Mean experienced decode tokens/s of the sessions the engines count as active (they
    leave out sessions still warming up), over several pools or replicas: the weighted
    mean Σ active_tps_sum / Σ n_active of what the engines report, never a mean of means
    and never recomputed from the sessions' own rates. Rounded to 0.1 so that jitter
    writes nothing; None when no session is active."""
    n, tps = 0, 0.0
    for c in counts:
        n += c.n_active
        tps += c.active_tps_sum
    return round(tps / n, 1) if n else None


# ------------------------------------------------------------------------------- pools


@dataclass
class PoolContext:
    """What the pool status needs to know about its namespace."""

    pools: Mapping[str, PoolNode]
    engines: Sequence[str]
    fleet: Mapping[str, EngineState]  # engine name -> state (absent: no round yet)
    selection: Selection
    _verdicts: dict[str, Verdict] = field(default_factory=dict)


def _serving(state: EngineState) -> list[Observation]:
    """Observations of replicas whose engine is up (reachable or not)."""
    return [
        o
        for name, o in sorted(state.replicas.items())
        if name in state.pods and state.pods[name].ready and not state.pods[name].terminating
    ]


def pool_verdict(node: PoolNode, ctx: PoolContext) -> Verdict:
    cached = ctx._verdicts.get(node.name)
    if cached is not None:
        return cached
    verdict = _pool_verdict(node, ctx)
    ctx._verdicts[node.name] = verdict
    return verdict


def _pool_verdict(node: PoolNode, ctx: PoolContext) -> Verdict:
    found = check(node, ctx.pools, ctx.engines)
    if isinstance(found, Problem):
        return Verdict("stalled" if found.stalled else "reconciling", found.reason, found.message)
    if len(found) > 1:
        parent = found[-2]
        pv = pool_verdict(parent, ctx)
        if pv.phase == "stalled":
            return Verdict.stalled(
                "ParentStalled", f'parent "{parent.name}" is stalled ({pv.reason}): {pv.message}'
            )
    state = ctx.fleet.get(node.engine)
    if state is None or state.rounds == 0:
        return Verdict.reconciling("WaitingForEngine", f'waiting for engine "{node.engine}"')
    render = state.renders.get(node.uid)
    if isinstance(render, RenderFailure):
        return Verdict.stalled(render.reason, render.message)
    serving = _serving(state)
    total = len([p for p in state.pods.values() if not p.terminating])
    if not serving:
        return Verdict.reconciling(
            "NoReadyReplica", f'engine "{node.engine}" has no running replica ({total} pods)'
        )
    if render is None:
        if len(found) > 1 and pool_verdict(found[-2], ctx).phase != "ready":
            return Verdict.reconciling(
                "WaitingForParent", f'waiting for parent "{found[-2].name}" to be materialized'
            )
        return Verdict.reconciling("Rendering", "rendering the prefix on the engine")
    errors = state.create_errors.get(node.uid, {})
    unreachable = [o for o in serving if not o.reachable]
    have = [o for o in serving if o.reachable and o.pool(node.name) is not None]
    full = sorted((pod, e.message) for pod, e in errors.items() if e.capacity)
    if full:
        pod, message = full[0]
        return Verdict.stalled(
            "EngineFull",
            f"replica {pod}: {message} ({len(full)} replica(s) full, every other pool there "
            "pinned or in use, so none could be evicted); raise the engine's spec.maxPools, "
            "unpin pools or delete some",
        )
    busy = sorted((pod, e.message) for pod, e in errors.items() if e.busy)
    if busy and len(have) < len(serving):
        pod, message = busy[0]
        return Verdict.reconciling(
            "EngineBusy", f"replica {pod} is busy: {message}; asked again shortly"
        )
    if unreachable:
        o = unreachable[0]
        return Verdict.unknown(
            "EngineUnreachable",
            f"replica {o.pod} ({o.ip}) does not answer: {o.error}; materialized on "
            f"{len(have)}/{len(serving)} replicas",
        )
    if len(have) < len(serving):
        detail = "; ".join(f"{pod}: {e.message}" for pod, e in sorted(errors.items()))
        return Verdict.reconciling(
            "Materializing",
            f"materialized on {len(have)}/{len(serving)} replicas"
            + (f" ({detail})" if detail else ""),
        )
    evicted = [o.pod for o in have if (p := o.pool(node.name)) and p.residency == "evicted"]
    if evicted:
        return Verdict.ready(
            "MaterializedEvicted",
            f"materialized on {len(have)}/{len(serving)} replicas; evicted (cold) on "
            f"{', '.join(evicted)} to fit the engine's maxPools: re-materialized on first use",
        )
    return Verdict.ready("Materialized", f"materialized on {len(have)}/{len(serving)} replicas")


def pool_status(
    node: PoolNode, ctx: PoolContext, previous: Sequence[Condition] | None
) -> PolyKVPoolStatus:
    verdict = pool_verdict(node, ctx)
    st = PolyKVPoolStatus(observed_generation=node.generation)
    found = check(node, ctx.pools, ctx.engines)
    if not isinstance(found, Problem):
        st.path = path_of(found)
        st.depth = len(found) - 1
    state = ctx.fleet.get(node.engine)
    if state is not None:
        render = state.renders.get(node.uid)
        if isinstance(render, Render):
            st.prefix_len, st.branch_pos, st.prefix_hash = (
                render.prefix_len,
                render.branch_pos,
                render.prefix_hash,
            )
        _observed(st, node.name, _serving(state))
    policy = ctx.selection.applied.get(node.name)
    if policy is not None:
        st.admission_policy = policy.name
    st.conditions = conditions_for(verdict, previous, node.generation)
    return st


def _observed(st: PolyKVPoolStatus, name: str, serving: Sequence[Observation]) -> None:
    replicas: list[PoolReplica] = []
    found: list[wire.PoolStatus] = []
    sessions = own = subtree = 0
    orphaned = False
    caps: list[wire.CapacitySummary] = []  # from the listing: one summary per replica
    for obs in serving:
        p = obs.pool(name)
        if p is None or obs.boot_id is None:
            continue
        replicas.append(
            PoolReplica(
                pod=obs.pod,
                pool_id=p.pool_id,
                boot_id=obs.boot_id,
                residency=p.residency,
                materialized_from=p.materialized_from,
            )
        )
        found.append(p)
        sessions += len(p.sessions)
        own += p.own_kv_bytes
        subtree += p.subtree_kv_bytes
        orphaned = orphaned or p.orphaned_pin
        if p.capacity is not None:
            caps.append(p.capacity)
    if not replicas:
        return
    st.replicas = replicas
    st.sessions = sessions
    st.mean_active_tps = mean_active_tps(found)
    st.own_kv_bytes, st.subtree_kv_bytes, st.orphaned_pin = own, subtree, orphaned
    if caps:
        st.compaction_pressure = round(max(c.compaction_pressure for c in caps), 2)
        refusing = [c for c in caps if not c.can_admit]
        st.capacity = PoolCapacity(
            can_admit=not refusing,
            reason=(refusing[0].reason if refusing else caps[0].reason),
            headroom_sessions=sum(c.headroom_sessions for c in caps),
            settling=any(c.settling for c in caps),
        )


def inputs_key(
    pools: Sequence[PoolNode], engines: Sequence[str], state: EngineState, selection: Selection
) -> int:
    """A fingerprint of everything the pool statuses of one engine are computed from: the
    namespace's pools (their versions cover their current status), the engines, the policy
    selection, and what the engine's last round saw. Equal keys: equal statuses, so an idle
    tree costs no status computation at all."""
    replicas = tuple(
        (
            name,
            o.reachable,
            o.error,
            o.boot_id,
            state.pods.get(name),
            tuple(
                (
                    p.name,
                    p.pool_id,
                    p.prefix_hash,
                    p.residency,
                    p.materialized_from,
                    p.orphaned_pin,
                    len(p.sessions),
                    p.own_kv_bytes,
                    p.subtree_kv_bytes,
                    p.n_active,
                    p.active_tps_sum,
                    None if (c := p.capacity) is None else tuple(c.model_dump().values()),
                )
                for p in (o.listing.pools if o.listing is not None else [])
            ),
        )
        for name, o in sorted(state.replicas.items())
    )
    return hash(
        (
            tuple((n.uid, n.resource_version, n.deleting) for n in pools),
            tuple(engines),
            tuple(sorted((k, p.uid, p.generation) for k, p in selection.applied.items())),
            tuple(sorted((k, tuple(v)) for k, v in selection.conflicts.items())),
            replicas,
            tuple(sorted(state.renders.items())),
            tuple(sorted((u, tuple(sorted(e.items()))) for u, e in state.create_errors.items())),
            tuple(sorted(state.pods.items())),
            state.rounds > 0,
        )
    )


# ------------------------------------------------------------------------------ engines


def engine_status(
    spec: PolyKVEngineSpec,
    name: str,
    generation: int,
    state: EngineState,
    declared: Sequence[PoolNode],
    previous: Sequence[Condition] | None,
    selector: str,
) -> PolyKVEngineStatus:
    pods = [p for p in state.pods.values() if not p.terminating]
    ready = [p for p in pods if p.ready and p.gate == "True"]
    names = {n.name for n in declared}
    evicted_total = 0
    totals = SnapshotTotals()
    rows: list[ReplicaStatus] = []
    for pod in sorted(pods, key=lambda p: p.name):
        obs = state.replicas.get(pod.name)
        row = ReplicaStatus(pod=pod.name, pod_ip=pod.ip, pools_ready=pod.gate == "True")
        if obs is not None and obs.reachable and obs.listing is not None:
            lst = obs.listing
            row.reachable = True
            row.boot_id = lst.boot_id
            row.seq_ids_used, row.seq_ids_max = lst.seq_ids_used, lst.seq_ids_max
            row.kv_cells_used, row.kv_cells_total = lst.kv_cells_used, lst.kv_cells_total
            row.sessions = sum(len(p.sessions) for p in lst.pools)
            row.mean_active_tps = mean_active_tps([lst])
            ours = [p for p in lst.pools if p.name in names]
            theirs = [p for p in lst.pools if p.name not in names]
            row.pools_evicted = sum(1 for p in ours if p.residency == "evicted")
            evicted_total += row.pools_evicted
            if lst.snapshots is not None:
                live = [p for p in ours if p.residency == "resident"]
                row.pools_restored = sum(1 for p in live if p.materialized_from in RESTORED)
                row.pools_rebuilt = sum(1 for p in live if p.materialized_from == "prefill")
                row.snapshot_bytes = lst.snapshots.used_bytes
                totals.restored += row.pools_restored
                totals.rebuilt += row.pools_rebuilt
                totals.bytes += row.snapshot_bytes
            row.unmanaged_pools = len(theirs)
            orphans = sorted(p.name or f"#{p.pool_id}" for p in theirs if p.orphaned_pin)
            row.orphaned_pins = orphans or None
        elif pod.waiting_reason:
            row.message = f"{pod.waiting_reason}: {pod.waiting_message or ''}".rstrip(": ")
        elif obs is not None and obs.error:
            row.message = obs.error
        elif not pod.ready:
            row.message = "engine starting"
        rows.append(row)
    serving = _serving(state)
    on_all = 0
    for node in declared:
        r = state.renders.get(node.uid)
        if isinstance(r, Render) and serving and all(o.pool(node.name) for o in serving):
            on_all += 1
    stuck = [p for p in pods if p.waiting_reason in STUCK_WAITING]
    if state.clash is not None:
        verdict = Verdict.stalled(NAME_CLASH, state.clash)
    elif stuck:
        p = stuck[0]
        verdict = Verdict.stalled(
            p.waiting_reason or "PodFailing",
            f"pod {p.name}: {p.waiting_message or p.waiting_reason}",
        )
    elif len(ready) == spec.replicas and len(pods) == spec.replicas and evicted_total:
        verdict = Verdict.ready(
            "PoolsEvicted",
            f"{len(ready)}/{spec.replicas} replicas ready; {len(declared)} declared pools "
            f"exceed maxPools {spec.max_pools}: {evicted_total} cold pool(s) evicted over the "
            "replicas, kept by name and re-materialized on first use",
        )
    elif len(ready) == spec.replicas and len(pods) == spec.replicas:
        verdict = Verdict.ready("ReplicasReady", f"{len(ready)}/{spec.replicas} replicas ready")
    else:
        verdict = Verdict.reconciling(
            "ReplicasNotReady", f"{len(ready)}/{spec.replicas} replicas ready ({len(pods)} pods)"
        )
    return PolyKVEngineStatus(
        observed_generation=generation,
        conditions=conditions_for(verdict, previous, generation),
        replicas=len(pods),
        ready_replicas=len(ready),
        selector=selector,
        pools=on_all,
        mean_active_tps=state.mean_active_tps,
        replica_status=rows,
        snapshots=totals if spec.snapshots.enabled else None,
    )


# ----------------------------------------------------------------------------- policies


def policy_status(
    policy: PolicyNode,
    selection: Selection,
    pools: Mapping[str, PoolNode],
    fleet: Mapping[str, EngineState],
    previous: Sequence[Condition] | None,
) -> AdmissionPolicyStatus:
    selected = selection.selected.get(policy.name, [])
    conflicts = [
        PolicyConflict(pool=pool, policies=names)
        for pool, names in sorted(selection.conflicts.items())
        if policy.name in names
    ]
    target = engine_policy(policy.spec)
    applied = 0
    errors: list[str] = []
    pending: list[str] = []
    for name in selected:
        if any(c.pool == name for c in conflicts):
            continue
        node = pools.get(name)
        state = fleet.get(node.engine) if node is not None else None
        if state is None:
            pending.append(name)
            continue
        if name in state.policy_errors:
            errors.append(f"{name}: {state.policy_errors[name]}")
        serving = [o for o in _serving(state) if o.reachable]
        if serving and all(
            (p := o.pool(name)) is not None and same_policy(p.admission, target) for o in serving
        ):
            applied += 1
        else:
            pending.append(name)
    if conflicts:
        c = conflicts[0]
        others = [n for n in c.policies if n != policy.name]
        verdict = Verdict.stalled(
            "PoolSelectedTwice",
            f'pool "{c.pool}" is also selected by {", ".join(others)}; neither policy is '
            "applied to it (the engine keeps its current policy) until the selections are "
            f"disjoint ({len(conflicts)} pool(s) in conflict)",
        )
    elif errors:
        verdict = Verdict.stalled("EngineRejected", "; ".join(errors))
    elif not selected:
        verdict = Verdict.ready("NoPoolsSelected", "the policy selects no pool")
    elif pending:
        verdict = Verdict.reconciling(
            "Applying", f"applied to {applied}/{len(selected)} pools; waiting for {pending[0]}"
        )
    else:
        verdict = Verdict.ready("Applied", f"applied to {applied} pools on every replica")
    return AdmissionPolicyStatus(
        observed_generation=policy.generation,
        conditions=conditions_for(verdict, previous, policy.generation),
        selected_pools=selected,
        applied_pools=applied,
        conflicts=conflicts or None,
    )


# ------------------------------------------------------------------------------ diffing


def patch_for(current: Mapping[str, Any] | None, new: KubeModel) -> dict[str, Any]:
    """The merge patch that turns `current` (the object's status) into `new`: only changed
    top-level fields, None for fields to remove; {} when nothing changed."""
    want = new.wire()
    have = dict(current or {})
    patch: dict[str, Any] = {k: v for k, v in want.items() if have.get(k) != v}
    for k in have:
        if k not in want:
            patch[k] = None
    return patch


def previous_conditions(status: Mapping[str, Any] | None) -> list[Condition]:
    out = []
    for raw in (status or {}).get("conditions") or []:
        try:
            out.append(Condition.model_validate(raw))
        except ValueError:
            continue
    return out
