"""The engine round against fake replicas: parents first, idempotent, restarts, policies."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import httpx
import pytest

from polykv_operator.engine_round import ClusterView, Round, drop_stale_gate
from polykv_operator.fleet import (
    EngineState,
    Render,
    RenderFailure,
    ReplicaRef,
    boot_named,
)
from polykv_operator.gates import GateWant
from polykv_operator.policies import PolicyNode
from polykv_operator.status import engine_status
from polykv_operator.tree import PoolNode

from .builders import NS, engine_spec, pod, policy, pool
from .fake_engine import FakeEngine, FakeFleet, FakePool

ROOT = "You are the crew."


class Harness:
    def __init__(self, n: int = 1) -> None:
        self.engines = {f"10.0.0.{i + 1}": FakeEngine(boot_id=f"boot-{i + 1}") for i in range(n)}
        self.pods = {f"eng-{i + 1}": pod(f"eng-{i + 1}", f"10.0.0.{i + 1}") for i in range(n)}
        self.state = EngineState((NS, "eng"), admin_key="k")
        self.gates: list[tuple[str, bool, str]] = []
        self.http = httpx.AsyncClient(transport=FakeFleet(self.engines).transport())
        self.spec = engine_spec()

    async def write_gate(self, name: str, want: GateWant) -> None:
        self.gates.append((name, want.status, want.reason))
        p = self.pods[name]
        # As the pod reads back: a raised gate's message names the engine boot.
        boot = boot_named(want.message) if want.status else None
        gate = "True" if want.status else "False"
        self.pods[name] = ReplicaRef(**{**p.__dict__, "gate": gate, "gate_boot": boot})

    def run(
        self, pools: Sequence[PoolNode], policies: Sequence[PolicyNode] = (), engines=("eng",)
    ) -> None:
        view = ClusterView(
            NS,
            "eng",
            self.spec,
            list(self.pods.values()),
            list(pools),
            list(policies),
            list(engines),
        )
        asyncio.run(Round(view, self.state, self.http, self.write_gate).run())

    def engine(self, i: int = 1) -> FakeEngine:
        return self.engines[f"10.0.0.{i}"]


def tree() -> list[PoolNode]:
    return [
        pool("root", text=ROOT),
        pool("extend", parent="root", appendText=" Brief: survey."),
        pool("branch", parent="root", text="You are the shell crew."),
    ]


def test_tree_materializes_parents_first_on_every_replica_in_one_round() -> None:
    h = Harness(2)
    h.run(tree())
    for i in (1, 2):
        eng = h.engine(i)
        creates = [c for c in eng.calls if c.startswith("POST") and "dry" not in c]
        assert creates[0] == "POST /polykv/pools"  # the root before its children
        assert set(eng.pools) == {"root", "extend", "branch"}
        assert eng.pools["extend"].branch_pos == len(ROOT)  # extend: the whole parent
        assert eng.pools["branch"].branch_pos == len("You are the ")  # branch inside it
    assert h.state.renders["uid-extend"] == Render(
        len(ROOT) + len(" Brief: survey."), len(ROOT), h.state.renders["uid-extend"].prefix_hash
    )
    assert sorted(h.gates) == [
        ("eng-1", True, "PoolsMaterialized"),
        ("eng-2", True, "PoolsMaterialized"),
    ]


def test_a_restarted_replica_is_told_to_restore_from_a_replica_that_holds_the_pools() -> None:
    h = Harness(2)
    h.run(tree())
    h.engine(2).restart("boot-2b")
    h.engine(2).peers.clear()
    h.run(tree())
    assert sorted(h.engine(2).peers) == [
        (n, "http://10.0.0.1:8080") for n in ("branch", "extend", "root")
    ]
    status = engine_status(engine_spec(), "eng", 1, h.state, tree(), None, "app=eng").snapshots
    assert status is not None
    assert (status.restored, status.rebuilt, status.bytes) == (3, 3, 2000)


def test_no_peer_is_named_when_snapshots_or_peers_are_off() -> None:
    for snapshots in ({"enabled": False}, {"fromPeers": False}):
        h = Harness(2)
        h.spec = engine_spec(snapshots=snapshots)
        h.run(tree())
        h.engine(2).restart("boot-2b")
        h.engine(2).peers.clear()
        h.run(tree())
        assert {peer for _, peer in h.engine(2).peers} == {None}


def test_a_second_round_changes_nothing() -> None:
    h = Harness(1)
    h.run(tree())
    before = list(h.engine().calls)
    h.run(tree())
    after = h.engine().calls[len(before) :]
    assert all(c.startswith("GET") for c in after), after
    assert len(h.gates) == 1


def test_restarted_replica_drops_its_gate_then_gets_the_tree_back() -> None:
    h = Harness(2)
    h.run(tree())
    h.engine(2).restart("boot-2b")
    h.gates.clear()
    h.run(tree())
    assert h.gates == [("eng-2", False, "EngineRestarted"), ("eng-2", True, "PoolsMaterialized")]
    assert set(h.engine(2).pools) == {"root", "extend", "branch"}


def test_a_new_operator_repairs_a_serving_replica_in_place() -> None:
    """After an operator restart nothing is synced; the boot the gate's message names
    vouches for the replica, so a pool declared meanwhile is added without taking it out."""
    h = Harness(1)
    h.run(tree())
    assert h.pods["eng-1"].gate_boot == "boot-1"
    h.state = EngineState((NS, "eng"), admin_key="k")  # the new operator's memory
    h.gates.clear()
    h.run([*tree(), pool("late", parent="root", text=ROOT + " Later.")])
    assert h.gates == []
    assert "late" in h.engine().pools


def test_a_new_operator_drops_the_gate_of_an_engine_that_restarted_meanwhile() -> None:
    """Its first round has no renders, so an empty engine looks complete: the gate's boot
    tells the restart, and the gate drops before the tree is re-created."""
    h = Harness(1)
    h.run(tree())
    h.engine().restart("boot-1b")
    h.state = EngineState((NS, "eng"), admin_key="k")
    h.gates.clear()
    h.run(tree())
    assert h.gates == [("eng-1", False, "EngineRestarted"), ("eng-1", True, "PoolsMaterialized")]
    assert set(h.engine().pools) == {"root", "extend", "branch"}
    assert h.pods["eng-1"].gate_boot == "boot-1b"


def test_too_large_branch_pos_stalls_the_pool_and_creates_nothing() -> None:
    h = Harness(1)
    bad = pool("bad", parent="root", text=ROOT + " more", branchPos=500)
    h.run([*tree(), bad])
    failure = h.state.renders["uid-bad"]
    assert isinstance(failure, RenderFailure)
    assert failure.reason == "BranchPosOutOfRange"
    assert f"({len(ROOT)} tokens)" in failure.message
    assert "bad" not in h.engine().pools
    # A stalled pool does not hold back the gate: the valid tree is served.
    assert h.gates == [("eng-1", True, "PoolsMaterialized")]


def test_engine_rejection_becomes_a_render_failure() -> None:
    h = Harness(1)
    # A pool of the same name, made by someone else with another prefix.
    h.engine().pools["root"] = FakePool(99, "root", None, [1, 2, 3], 0)
    h.run([pool("root", text=ROOT)])
    failure = h.state.renders["uid-root"]
    assert isinstance(failure, RenderFailure) and failure.reason == "NameConflict"
    assert "DELETE /polykv/pools/root" in failure.message


def test_children_of_a_missing_parent_wait() -> None:
    h = Harness(1)
    h.run([pool("orphan", parent="ghost", text="x")])
    assert h.engine().pools == {}
    assert "uid-orphan" not in h.state.renders


def test_a_tree_larger_than_the_engine_evicts_cold_pools_and_the_gate_rises() -> None:
    h = Harness(1)
    h.engine().max_pools = 2
    roots = [pool(f"r{i}", text=f"Root number {i}.") for i in range(5)]
    h.run(roots)
    eng = h.engine()
    assert sorted(eng.pools) == [f"r{i}" for i in range(5)]  # every pool, by name
    assert len(eng.resident()) == 2 and sum(p.evicted for p in eng.pools.values()) == 3
    assert not any(h.state.create_errors.values())
    assert h.gates == [("eng-1", True, "PoolsMaterialized")]
    st = engine_status(engine_spec(maxPools=2), "eng", 1, h.state, roots, None, "s")
    ready = {c.type: c for c in st.conditions or []}["Ready"]
    assert ready.status == "True" and ready.reason == "PoolsEvicted", ready
    assert st.replica_status and st.replica_status[0].pools_evicted == 3
    h.run(roots)  # steady: nothing created or evicted again
    assert sum(c.endswith("/evict") for c in eng.calls) == 3


def test_pools_that_cannot_fit_do_not_hold_the_gate() -> None:
    h = Harness(1)
    eng = h.engine()
    eng.max_pools = 1
    eng.pools["pinned"] = FakePool(99, "pinned", None, [1, 2], 0, pinned=True)  # not ours
    h.run(tree())
    errors = [e for errs in h.state.create_errors.values() for e in errs.values()]
    assert errors and errors[0].capacity and "no free pool sequence id" in errors[0].message
    assert h.gates == [("eng-1", True, "PoolsMaterialized")]
    creates = len([c for c in eng.calls if c == "POST /polykv/pools"])
    h.run(tree())  # a full replica is not asked again at every round
    assert len([c for c in eng.calls if c == "POST /polykv/pools"]) == creates
    assert h.state.orphaned_pins == 1 and h.state.unmanaged_pools == 1


def test_a_busy_engine_is_a_refusal_not_a_dead_replica() -> None:
    h = Harness(1)
    h.engine().busy = "queue_full"
    h.run([pool("root", text=ROOT)])
    (err,) = h.state.create_errors["uid-root"].values()
    assert err.busy and not err.capacity and h.state.replicas["eng-1"].reachable
    h.engine().busy = None
    h.run([pool("root", text=ROOT)])
    assert "root" not in h.engine().pools  # asked again after CAPACITY_RETRY_S, not at once


def test_policies_are_pushed_and_cleared_and_conflicts_left_alone() -> None:
    h = Harness(1)
    pools = [
        pool("root", text=ROOT, labels={"tier": "a"}),
        pool("other", text="Other root", labels={"tier": "b"}),
    ]
    one = policy("floor", poolSelector={"matchLabels": {"tier": "a"}}, mode="enforced")
    h.run(pools, [one])
    assert h.engine().pools["root"].admission is not None
    assert h.engine().pools["root"].admission.mode == "enforced"
    assert h.engine().pools["other"].admission is None
    # A second policy on the same pool: neither is applied anew, the engine keeps its own.
    two = policy("floor2", poolRefs=[{"name": "root"}], targetTpsPerSession=9)
    h.run(pools, [one, two])
    assert h.engine().pools["root"].admission.target_tps_per_session == 5
    # No policy any more: cleared.
    h.run(pools, [])
    assert h.engine().pools["root"].admission is None


def test_policies_come_back_after_a_restart_before_the_gate() -> None:
    h = Harness(1)
    pools = [pool("root", text=ROOT, labels={"tier": "a"})]
    pol = [policy("floor", poolSelector={"matchLabels": {"tier": "a"}})]
    h.run(pools, pol)
    h.engine().restart("boot-x")
    h.run(pools, pol)
    assert h.engine().pools["root"].admission is not None
    assert h.gates[-1] == ("eng-1", True, "PoolsMaterialized")


def test_unreachable_replica_is_not_gated_up_and_others_proceed() -> None:
    h = Harness(2)
    h.engine(2).down = True
    h.run(tree())
    assert ("eng-1", True, "PoolsMaterialized") in h.gates
    assert ("eng-2", False, "EngineUnreachable") in h.gates
    assert not h.state.replicas["eng-2"].reachable


def test_deleting_pools_are_not_created() -> None:
    h = Harness(1)
    pools = [pool("root", text=ROOT), pool("gone", parent="root", appendText="!", deleting=True)]
    h.run(pools)
    assert set(h.engine().pools) == {"root"}


def test_a_steady_round_is_one_listing_per_replica_and_it_carries_capacity() -> None:
    h = Harness(2)
    h.run(tree())
    for i in (1, 2):
        h.engine(i).calls.clear()
    h.run(tree())
    for i in (1, 2):
        assert h.engine(i).calls == ["GET /polykv/pools"]  # no per-pool capacity reads
        obs = h.state.replicas[f"eng-{i}"]
        for name in ("root", "extend", "branch"):
            p = obs.pool(name)
            assert p is not None and p.capacity is not None
            assert p.capacity.compaction_pressure == pytest.approx(0.25)


def test_a_pod_event_drops_a_stale_gate_at_once() -> None:
    h = Harness(1)
    h.run(tree())
    p = h.pods["eng-1"]
    assert asyncio.run(drop_stale_gate(h.state, p, h.write_gate)) is None  # still serving
    restarted = replace(p, restarts=1)
    want = asyncio.run(drop_stale_gate(h.state, restarted, h.write_gate))
    assert want is not None and want.reason == "EngineRestarted"
    assert h.gates[-1] == ("eng-1", False, "EngineRestarted")
    assert p.uid not in h.state.synced


def test_the_round_keeps_the_fleets_mean_active_tps() -> None:
    h = Harness(2)
    h.run(tree())
    assert h.state.mean_active_tps is None  # nobody decoding
    h.engine(1).pools["root"].rates = [10.0]
    h.engine(2).pools["extend"].rates = [20.0, 30.0]
    h.engine(2).pools["branch"].warming = 3
    h.run(tree())
    assert h.state.mean_active_tps == 20.0  # 60 tokens/s over 3 active sessions
    h.engine(2).down = True  # an unreachable replica's last figures do not count
    h.run(tree())
    assert h.state.mean_active_tps == 10.0


def test_a_round_that_read_the_cluster_before_a_release_does_not_create_the_pool_again() -> None:
    h = Harness(1)
    pools = tree()
    h.run(pools)
    eng = h.engine()
    leaf = next(p for p in pools if p.name == "branch")
    h.state.deleting.add(leaf.uid)  # the finalizer began, released it, and forgot it
    del eng.pools["branch"]
    h.state.forget_pool(leaf.uid)
    h.run(pools)  # a snapshot from before the delete: the pool is still listed, not deleting
    assert "branch" not in eng.pools
    h.run([p for p in pools if p.name != "branch"])  # the object is gone
    assert leaf.uid not in h.state.deleting


def test_an_unchanged_listing_is_revalidated_not_parsed_again() -> None:
    h = Harness(1)
    h.run(tree())  # creates: the listing was changed in place, so it has no ETag
    assert h.state.replicas["eng-1"].etag is None
    h.run(tree())
    held = h.state.replicas["eng-1"].listing
    assert h.state.replicas["eng-1"].etag is not None and h.engine().not_modified == 0
    h.run(tree())
    assert h.engine().not_modified == 1
    assert h.state.replicas["eng-1"].listing is held  # the same object: nothing parsed
