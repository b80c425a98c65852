"""pod-deletion-cost: the sessions each replica holds, written by the round when it changes."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx

from polykv_operator.autoscale import deletion_cost
from polykv_operator.engine_round import ClusterView, Round
from polykv_operator.fleet import EngineState, Observation, ReplicaRef
from polykv_operator.gates import GateWant

from .builders import NS, engine_spec, pod, pool
from .fake_engine import FakeEngine, FakeFleet, FakePool


def test_held_sessions_count_pooled_and_unpooled() -> None:
    eng = FakeEngine(unpooled=2)
    eng.pools["a"] = FakePool(1, "a", None, [1], 0, rates=[3.0, 4.0], warming=1)
    eng.pools["b"] = FakePool(2, "b", None, [2], 0)
    assert deletion_cost.held_sessions(eng.listing()) == 5


def test_wanted_skips_unanswered_leaving_and_unchanged_pods() -> None:
    eng = FakeEngine()
    eng.pools["a"] = FakePool(1, "a", None, [1], 0, rates=[3.0])
    listing = eng.listing()
    pods = {
        "same": pod("same", "10.0.0.1", deletion_cost="1"),
        "new": pod("new", "10.0.0.2"),
        "silent": pod("silent", "10.0.0.3", deletion_cost="7"),
        "leaving": pod("leaving", "10.0.0.4", terminating=True),
        "restarted": pod("restarted", "10.0.0.5"),
    }
    replicas = {
        "same": Observation("same", "uid-same", "10.0.0.1", True, None, listing),
        "new": Observation("new", "uid-new", "10.0.0.2", True, None, listing),
        "silent": Observation("silent", "uid-silent", "10.0.0.3", False, "timeout"),
        "leaving": Observation("leaving", "uid-leaving", "10.0.0.4", True, None, listing),
        "restarted": Observation("restarted", "uid-before", "10.0.0.5", True, None, listing),
    }
    assert deletion_cost.wanted(pods, replicas, {}) == {"new": "1"}


def test_a_sent_value_is_not_resent_until_the_index_moves() -> None:
    p = pod("a", "10.0.0.1", deletion_cost="0")
    sent: deletion_cost.Sent = {}
    assert deletion_cost.needs(sent, p, "3")
    deletion_cost.record(sent, p, "3")
    assert not deletion_cost.needs(sent, p, "3")  # the watch has not shown our write yet
    assert not deletion_cost.needs(sent, replace(p, deletion_cost="3"), "3")  # it has
    # Someone else wrote 9 after us: ours is written again.
    assert deletion_cost.needs(sent, replace(p, deletion_cost="9"), "3")


class Writes:
    def __init__(self) -> None:
        self.costs: list[tuple[str, str]] = []
        self.fail = False

    async def gate(self, name: str, want: GateWant) -> None:
        pass

    async def cost(self, name: str, value: str) -> None:
        if self.fail:
            raise RuntimeError("API server unavailable")
        self.costs.append((name, value))


def run(
    state: EngineState, pods: list[ReplicaRef], engines: dict[str, FakeEngine], w: Writes
) -> None:
    http = httpx.AsyncClient(transport=FakeFleet(engines).transport())
    view = ClusterView(NS, "eng", engine_spec(), pods, [pool("a")], [], ["eng"])
    asyncio.run(Round(view, state, http, w.gate, w.cost).run())


def test_the_round_writes_each_pods_sessions_once_and_again_on_change() -> None:
    engines = {"10.0.0.1": FakeEngine(unpooled=1), "10.0.0.2": FakeEngine()}
    pods = [pod("eng-1", "10.0.0.1"), pod("eng-2", "10.0.0.2")]
    state, w = EngineState((NS, "eng"), admin_key="k"), Writes()
    run(state, pods, engines, w)
    assert sorted(w.costs) == [("eng-1", "1"), ("eng-2", "0")]
    run(state, pods, engines, w)  # the index has not caught up: nothing again
    assert len(w.costs) == 2
    engines["10.0.0.2"].pools["a"].rates = [5.0, 6.0]  # two agents attach to eng-2
    seen = [replace(pods[0], deletion_cost="1"), replace(pods[1], deletion_cost="0")]
    run(state, seen, engines, w)
    assert w.costs[2:] == [("eng-2", "2")]


def test_a_failed_cost_write_is_retried_by_the_next_round() -> None:
    engines = {"10.0.0.1": FakeEngine(unpooled=3)}
    pods = [pod("eng-1", "10.0.0.1")]
    state, w = EngineState((NS, "eng"), admin_key="k"), Writes()
    w.fail = True
    run(state, pods, engines, w)
    assert w.costs == [] and state.costs_sent == {}
    w.fail = False
    run(state, pods, engines, w)
    assert w.costs == [("eng-1", "3")]
