"""Releasing a pool on every replica: released, absent, refused or unreachable. The
finalizer around it (children first, the pool's conditions while it waits) runs against
the real API server: tests/e2e/polykv/test_pool_finalizer.py."""

from __future__ import annotations

import asyncio

import httpx

from polykv_operator.fleet import EngineState
from polykv_operator.pool_release import release_everywhere

from .builders import NS, pod
from .fake_engine import FakeEngine, FakeFleet, FakePool


def run(engines: dict[str, FakeEngine], pods, name: str):  # type: ignore[no-untyped-def]
    http = httpx.AsyncClient(transport=FakeFleet(engines).transport())
    state = EngineState((NS, "eng"), admin_key="k")
    return asyncio.run(release_everywhere(state, pods, http, 8080, name))


def with_pools(*names: str, parent: str | None = None) -> FakeEngine:
    eng = FakeEngine()
    for i, n in enumerate(names):
        eng.pools[n] = FakePool(i + 1, n, parent if i else None, [1, 2], 1 if i else 0)
    return eng


def test_released_where_present_absent_elsewhere() -> None:
    a, b = with_pools("root"), FakeEngine()
    out = run({"10.0.0.1": a, "10.0.0.2": b}, [pod("a", "10.0.0.1"), pod("b", "10.0.0.2")], "root")
    assert out.done and out.released == ["a"] and out.absent == ["b"]
    assert a.pools == {}


def test_a_replica_that_does_not_answer_keeps_it() -> None:
    down = with_pools("root")
    down.down = True
    out = run({"10.0.0.1": down}, [pod("a", "10.0.0.1")], "root")
    assert not out.done and "ConnectError" in out.unreachable["a"]


def test_children_on_the_engine_block_the_release() -> None:
    eng = with_pools("root", "agent-fork", parent="root")
    out = run({"10.0.0.1": eng}, [pod("a", "10.0.0.1")], "root")
    assert not out.done and "child pools" in out.blocked["a"]
    assert "root" in eng.pools


def test_pods_without_an_engine_process_hold_nothing() -> None:
    pods = [
        pod("gone", None),
        pod("stopped", "10.0.0.1", ready=False),
        pod("leaving", "10.0.0.2", terminating=True),
    ]
    out = run({}, pods, "root")
    assert out.done and not out.released and not out.absent
