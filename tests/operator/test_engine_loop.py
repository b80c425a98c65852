"""The engine's loop against fake replicas: rounds when poked, quiet checks when idle, and
the statuses each cycle writes (only what changed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from polykv_operator.engine_loop import Snapshot, run_cycle, serve, write_pool_statuses
from polykv_operator.engine_round import ClusterView
from polykv_operator.fleet import Fleet
from polykv_operator.tree import PoolNode

from .builders import NS, engine_spec, pool
from .test_engine_round import ROOT, Harness, tree


def test_a_cycle_writes_the_engine_status_and_then_nothing() -> None:
    h = Harness(1)
    view = ClusterView(NS, "eng", engine_spec(), list(h.pods.values()), tree(), [], ["eng"])
    fleet = Fleet()
    fleet.engines[(NS, "eng")] = h.state
    writes: list[tuple[str, str, dict[str, Any]]] = []

    async def write_status(plural: str, name: str, patch: dict[str, Any]) -> None:
        writes.append((plural, name, patch))

    def engine_writes() -> list[dict[str, Any]]:
        # The index still shows the status from before our write: the memo knows better.
        snap = Snapshot(view, "uid-eng", 3, {}, "1")
        asyncio.run(run_cycle(snap, h.state, fleet, h.http, h.write_gate, write_status))
        return [patch for plural, _, patch in writes if plural == "polykvengines"]

    first = engine_writes()
    assert len(first) == 1
    assert first[0]["observedGeneration"] == 3 and first[0]["pools"] == 3
    assert first[0]["selector"] == "polykv.io/engine=eng"
    assert engine_writes() == first  # the status as written, nothing new: no write


def test_the_loop_runs_a_round_when_poked_and_writes_only_what_changed() -> None:
    h = Harness(1)
    writes: list[tuple[str, str, dict[str, Any]]] = []

    async def write_status(plural: str, name: str, patch: dict[str, Any]) -> None:
        writes.append((plural, name, patch))

    pools = [pool("root", text=ROOT)]
    fleet = Fleet()
    fleet.engines[(NS, "eng")] = h.state

    def snapshot() -> Snapshot:
        view = ClusterView(
            NS, "eng", engine_spec(), list(h.pods.values()), list(pools), [], ["eng"]
        )
        return Snapshot(view, "uid-eng", 1, {}, "1")

    async def finished(n: int) -> int:
        # A round at once (first start, then the poke), not at the 30 s interval; waited for
        # to its end (statuses written), not its start.
        for _ in range(3000):
            if h.state.rounds_done >= n:
                return h.state.rounds
            await asyncio.sleep(0.02)
        raise AssertionError(f"round {n} did not finish; {h.state.rounds} begun")

    async def scenario() -> list[int]:
        task = asyncio.create_task(
            serve(h.state, snapshot, fleet, h.http, h.write_gate, write_status, 30.0, lambda: False)
        )
        seen = [await finished(1)]
        pools.append(pool("extra", text="Another root."))
        h.state.poke()
        seen.append(await finished(2))
        task.cancel()
        return seen

    assert asyncio.run(scenario()) == [1, 2]
    assert set(h.engine().pools) == {"root", "extra"}
    kinds = [(plural, name) for plural, name, _ in writes]
    assert kinds.count(("polykvpools", "root")) == 1  # written once; the memo held it since
    ready = {c["type"]: c["status"] for c in writes[1][2]["conditions"]}
    assert writes[1][1] == "root" and ready["Ready"] == "True"


def test_a_lagging_watch_gets_no_status_written_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The index still shows the status from before our write (a thousand pools changed at
    once): later rounds, seconds apart, write nothing for a pool whose verdict holds."""
    from polykv_operator import conditions

    h = Harness(1)
    pools = [pool("root", text=ROOT), pool("other", text="Another root.")]
    h.run(pools)
    fleet = Fleet()
    fleet.engines[(NS, "eng")] = h.state
    writes: list[str] = []

    async def write_status(plural: str, name: str, patch: dict[str, Any]) -> None:
        writes.append(name)

    view = ClusterView(NS, "eng", engine_spec(), list(h.pods.values()), pools, [], ["eng"])
    for second in range(3):  # stale index: status {} and the same resourceVersion each time
        monkeypatch.setattr(conditions, "now_rfc3339", lambda s=second: f"2026-01-01T00:00:0{s}Z")
        asyncio.run(write_pool_statuses(view, h.state, fleet, write_status))
    assert sorted(writes) == ["other", "root"]
    # Someone else's write (a newer version, another status): corrected once.
    pools[0] = replace(pools[0], status={"path": "elsewhere"}, resource_version="9")
    view = replace(view, pools=pools)
    asyncio.run(write_pool_statuses(view, h.state, fleet, write_status))
    assert sorted(writes) == ["other", "root", "root"]


class Loop:
    """`serve` for one engine at a short interval, with the cluster as `pools` (use inside
    one event loop: the engine state's wake event binds to it)."""

    def __init__(self, h: Harness, pools: list[PoolNode]) -> None:
        self.h, self.pools, self.fleet = h, pools, Fleet()
        self.fleet.engines[(NS, "eng")] = h.state
        self.task: asyncio.Task[None] | None = None

    def snapshot(self) -> Snapshot:
        h = self.h
        view = ClusterView(
            NS, "eng", engine_spec(), list(h.pods.values()), list(self.pools), [], ["eng"]
        )
        return Snapshot(view, "uid-eng", 1, {}, "1", changes=self.fleet.changes(NS))

    async def until(self, what: Callable[[], bool]) -> None:
        if self.task is None:
            h = self.h
            args = (h.state, self.snapshot, self.fleet, h.http, h.write_gate, self.write_status)
            self.task = asyncio.create_task(serve(*args, 0.01, lambda: False))
        for _ in range(3000):  # state, not time: a loaded machine may take a while
            await asyncio.sleep(0.01)
            if what():
                return
        raise AssertionError("condition not reached")

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def write_status(self, plural: str, name: str, patch: dict[str, Any]) -> None:
        pass


def test_an_idle_engine_gets_quiet_checks_not_rounds_until_something_changes() -> None:
    h = Harness(2)
    loop = Loop(h, tree())
    st = h.state

    def posts() -> int:
        return sum(c.startswith("POST") for e in h.engines.values() for c in e.calls)

    async def scenario() -> None:
        await loop.until(lambda: st.quiet_rounds >= 3)
        rounds = st.rounds  # the creates, one round to see them settled, then only checks
        assert st.settled is not None and rounds <= 3
        made = posts()
        await loop.until(lambda: st.quiet_rounds >= 10)
        assert st.rounds == rounds and posts() == made  # idle: no round, however many pools

        # A replica that lost its KV changes its listing: the next check runs a round.
        h.engine(2).restart("boot-2b")
        await loop.until(lambda: set(h.engine(2).pools) == {"root", "extend", "branch"})
        assert st.rounds > rounds

        # A cluster change (any event of the namespace) runs a round, without a poke.
        await loop.until(lambda: st.settled is not None)
        rounds = st.rounds
        loop.pools.append(pool("late", text="A late root."))
        loop.fleet.touch(NS)
        await loop.until(lambda: "late" in h.engine(1).pools)
        assert st.rounds > rounds
        loop.stop()

    asyncio.run(scenario())


def test_no_quiet_check_while_something_waits_for_a_retry() -> None:
    h = Harness(1)
    h.engine().busy = "kv_full"  # every create refused for room: retried later, not now
    loop = Loop(h, [pool("root", text=ROOT)])
    st = h.state

    async def scenario() -> None:
        await loop.until(lambda: st.rounds >= 5)
        assert st.create_errors["uid-root"] and st.settled is None and st.quiet_rounds == 0
        h.engine().busy = None
        h.engine().etags = False  # an engine without ETags: every round is a full one
        st.create_errors.clear()
        await loop.until(lambda: "root" in h.engine().pools and st.rounds >= 10)
        assert st.settled is None and st.quiet_rounds == 0
        loop.stop()

    asyncio.run(scenario())
