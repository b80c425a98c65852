"""The engine round against fake replicas: parents first, idempotent, restarts, policies."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx
import pytest

from polykv_operator.engine_round import ClusterView, Round, drop_stale_gate, run_round
from polykv_operator.fleet import EngineState, Render, RenderFailure, ReplicaRef
from polykv_operator.gates import GateWant
from polykv_operator.policies import PolicyNode
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

    async def write_gate(self, name: str, want: GateWant) -> None:
        self.gates.append((name, want.status, want.reason))
        p = self.pods[name]
        self.pods[name] = ReplicaRef(**{**p.__dict__, "gate": "True" if want.status else "False"})

    def run(
        self, pools: Sequence[PoolNode], policies: Sequence[PolicyNode] = (), engines=("eng",)
    ) -> None:
        view = ClusterView(
            NS,
            "eng",
            engine_spec(),
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


def test_full_engine_is_recorded_per_replica() -> None:
    h = Harness(1)
    h.engine().max_pools = 2
    h.run(tree())
    assert len(h.engine().pools) == 2
    errors = [e for errs in h.state.create_errors.values() for e in errs.values()]
    assert errors and errors[0].capacity and "no free pool sequence id" in errors[0].message
    assert h.gates == [("eng-1", False, "Materializing")]


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


def test_run_round_returns_the_status_patch_and_then_nothing() -> None:
    h = Harness(1)
    view = ClusterView(NS, "eng", engine_spec(), list(h.pods.values()), tree(), [], ["eng"])

    def once(status: dict[str, Any] | None) -> dict[str, Any]:
        return asyncio.run(run_round(view, h.state, h.http, h.write_gate, 3, status))

    first = once(None)
    assert first["observedGeneration"] == 3 and first["pools"] == 3
    assert first["selector"] == "polykv.io/engine=eng"
    assert once(first) == {}  # the status as written, nothing new: no write


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
