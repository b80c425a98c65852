"""The pool finalizer: children first; then released, absent, refused or unreachable on
every replica, with the pool's conditions while it waits."""

from __future__ import annotations

import asyncio
import time

import httpx

from polykv_operator.fleet import EngineState, Fleet, Render
from polykv_operator.kube import Kube
from polykv_operator.pool_release import Holder, finalize_pool, release_everywhere

from .builders import NS, pod, pool
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


class KubeCalls:
    """A Kube whose API server only records what is asked of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

        def handler(req: httpx.Request) -> httpx.Response:
            self.calls.append(f"{req.method} {req.url.path}")
            return httpx.Response(200, json={})

        self.kube = Kube(
            httpx.AsyncClient(base_url="https://api", transport=httpx.MockTransport(handler))
        )


def finalize(engines, pods, pools, holder=True, status=None, fleet=None):  # type: ignore[no-untyped-def]
    http = httpx.AsyncClient(transport=FakeFleet(engines).transport())
    state = EngineState((NS, "eng"), admin_key="k")
    state.renders["uid-root"] = Render(2, 0, "h")
    kube = KubeCalls()
    held = Holder(state, pods, 8080) if holder else None
    fleet = fleet or Fleet()
    waiting = asyncio.run(
        finalize_pool(
            NS, "root", "uid-root", lambda: pools, held, http, kube.kube, status, fleet, 0.05
        )
    )
    return waiting, state, kube.calls


def test_finalize_deletes_children_first_and_waits() -> None:
    pools = [pool("root"), pool("a", parent="root"), pool("b", parent="root", deleting=True)]
    waiting, _, calls = finalize({}, [], pools)
    assert calls == [f"DELETE /apis/polykv.io/v1alpha1/namespaces/{NS}/polykvpools/a"]
    assert waiting is not None and waiting.message.endswith("a, b") and waiting.delay == 1
    busy = {c["type"]: c for c in waiting.status_patch["conditions"]}["Reconciling"]
    assert busy["reason"] == "DeletingChildren"
    # The same conditions again are no news: nothing to patch.
    again, _, _ = finalize({}, [], pools, status={"conditions": waiting.status_patch["conditions"]})
    assert again is not None and again.status_patch == {}


def test_finalize_forgets_a_pool_released_everywhere() -> None:
    eng = with_pools("root")
    waiting, state, _ = finalize({"10.0.0.1": eng}, [pod("a", "10.0.0.1")], [pool("root")])
    assert waiting is None and eng.pools == {}
    assert "uid-root" not in state.renders
    assert state.deleting == {"uid-root"}  # until the object is gone: no round re-creates it


def test_finalize_without_an_engine_lets_the_pool_go() -> None:
    waiting, _, calls = finalize({}, [], [pool("root")], holder=False)
    assert waiting is None and calls == []


def test_finalize_keeps_the_finalizer_while_a_replica_does_not_answer() -> None:
    down = with_pools("root")
    down.down = True
    waiting, state, _ = finalize({"10.0.0.1": down}, [pod("a", "10.0.0.1")], [pool("root")])
    assert waiting is not None and "does not answer" in waiting.message
    ready = {c["type"]: c for c in waiting.status_patch["conditions"]}["Ready"]
    assert ready["status"] == "Unknown" and ready["reason"] == "EngineUnreachable"
    assert state.deleting == {"uid-root"}


def test_a_parent_goes_on_as_soon_as_its_children_are_released() -> None:
    """One step per tree level: no retry back-off between a child's release and its parent's."""
    eng = with_pools("root")
    pools = [pool("root"), pool("a", parent="root", deleting=True)]
    fleet = Fleet()

    async def scenario() -> tuple[object, float]:
        http = httpx.AsyncClient(transport=FakeFleet({"10.0.0.1": eng}).transport())
        state = EngineState((NS, "eng"), admin_key="k")
        held = Holder(state, [pod("p", "10.0.0.1")], 8080)
        t0 = time.monotonic()
        parent = asyncio.create_task(
            finalize_pool(
                NS, "root", "uid-root", lambda: pools, held, http, KubeCalls().kube, None, fleet, 30
            )
        )
        await asyncio.sleep(0.1)
        assert not parent.done()  # waiting for "a"
        await fleet.mark_released("uid-a", {"uid-root", "uid-a"})
        return await parent, time.monotonic() - t0

    waiting, took = asyncio.run(scenario())
    assert waiting is None and eng.pools == {} and took < 10  # not the 30 s wait
    assert "uid-root" in fleet.released and "uid-a" in fleet.released


def test_a_release_refused_again_and_again_turns_stalled() -> None:
    eng = with_pools("root", "agent-fork", parent="root")
    pods = [pod("a", "10.0.0.1")]
    http = httpx.AsyncClient(transport=FakeFleet({"10.0.0.1": eng}).transport())
    state = EngineState((NS, "eng"), admin_key="k")
    held = Holder(state, pods, 8080)
    fleet = Fleet()
    reasons = []
    for _ in range(3):
        waiting = asyncio.run(
            finalize_pool(
                NS,
                "root",
                "uid-root",
                lambda: [pool("root")],
                held,
                http,
                KubeCalls().kube,
                None,
                fleet,
            )
        )
        assert waiting is not None
        conds = {c["type"]: c for c in waiting.status_patch["conditions"]}
        reasons.append((conds["Stalled"]["status"], conds["Ready"]["reason"]))
    assert reasons == [
        ("False", "ReleaseRefused"),
        ("False", "ReleaseRefused"),
        ("True", "ReleaseRefused"),
    ]
    assert "remove the finalizer by hand" in waiting.message and "child pools" in waiting.message
