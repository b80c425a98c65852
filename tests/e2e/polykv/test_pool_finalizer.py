"""The pool finalizer's use case (pool_release.finalize_pool) on the real API server, with
the operator's own credentials: its child deletes go through RBAC and the admission policy
as the operator's would, so a wrong path, a missing verb or a refused write fails here.

The pools are real PolyKVPool objects (no operator runs: nothing else touches them); the
live index is read from the API server at every call. The engine replicas are the fake
engine (tests/operator/fake_engine.py, held to a real engine by its contract test).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import kopf
import pytest
import yaml

from polykv_operator.api import PolyKVPoolSpec
from polykv_operator.fleet import EngineState, Fleet, Render
from polykv_operator.kube import Kube
from polykv_operator.pool_release import Holder, Waiting, finalize_pool
from polykv_operator.tree import PoolNode
from polykv_testenv import ControlPlane

from ...operator.builders import pod
from ...operator.fake_engine import FakeEngine, FakeFleet, FakePool
from ..helpers import Obj, get_or_none
from .test_operator import apply, obj_path, pool_manifest

pytestmark = pytest.mark.k8s

HOLD = "test.polykv.io/hold"  # a finalizer of the test's: keeps a deleted pool "deleting"
T = TypeVar("T")


class Pools:
    """Real PolyKVPool objects in one namespace, and the finalizer's view of them."""

    def __init__(self, cluster: ControlPlane, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace

    def create(self, name: str, parent: str | None = None, hold: bool = False) -> str:
        spec: Obj = {"text": f"prefix of {name}"} if parent is None else {"appendText": " more"}
        if parent is not None:
            spec["parent"] = parent
        body = pool_manifest(name, **spec)
        if hold:
            body["metadata"]["finalizers"] = [HOLD]
        apply(self.cluster, self.namespace, body)
        return str(self.get(name)["metadata"]["uid"])

    def get(self, name: str) -> Obj:
        return self.cluster.api.get(self.path(name))

    def get_or_none(self, name: str) -> Obj | None:
        return get_or_none(self.cluster.api, self.path(name))

    def path(self, name: str) -> str:
        return obj_path(self.namespace, "polykvpools", name)

    def delete(self, name: str) -> None:
        self.cluster.kubectl("delete", "polykvpool", name, "-n", self.namespace, "--wait=false")

    def release(self, name: str) -> None:
        """Takes the test's finalizer off, so that a deleting pool goes."""
        patch = [{"op": "remove", "path": "/metadata/finalizers"}]
        self.cluster.api.patch(self.path(name), patch, content_type="application/json-patch+json")

    def live(self) -> list[PoolNode]:
        """The pools as the operator's index holds them."""
        items = self.cluster.api.get(obj_path(self.namespace, "polykvpools"))["items"]
        return [
            PoolNode(
                namespace=self.namespace,
                name=o["metadata"]["name"],
                uid=o["metadata"]["uid"],
                spec=PolyKVPoolSpec.model_validate(o["spec"]),
                deleting=bool(o["metadata"].get("deletionTimestamp")),
            )
            for o in items
        ]


@pytest.fixture
def pools(k8s_cluster: ControlPlane, namespace: str, operator_kubeconfig: Path) -> Iterator[Pools]:
    out = Pools(k8s_cluster, namespace)
    yield out
    for o in k8s_cluster.api.get(obj_path(namespace, "polykvpools"))["items"]:
        if HOLD in (o["metadata"].get("finalizers") or []):
            out.release(o["metadata"]["name"])


def as_operator(cluster: ControlPlane, kubeconfig: Path, body: Callable[[Kube], Awaitable[T]]) -> T:
    """Runs `body` with a Kube logged in as the operator's ServiceAccount, the way the
    operator makes its own (Kube.from_connection over kopf's connection info)."""
    token = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
    info = kopf.ConnectionInfo(
        server=cluster.credentials.server, ca_path=str(cluster.credentials.ca_file), token=token
    )

    async def run() -> T:
        kube = Kube.from_connection(info)
        try:
            return await body(kube)
        finally:
            await kube.close()

    return asyncio.run(run())


def with_pools(*names: str, parent: str | None = None) -> FakeEngine:
    eng = FakeEngine()
    for i, n in enumerate(names):
        eng.pools[n] = FakePool(i + 1, n, parent if i else None, [1, 2], 1 if i else 0)
    return eng


def finalize(
    cluster: ControlPlane,
    kubeconfig: Path,
    pools: Pools,
    root_uid: str,
    engines: dict[str, FakeEngine],
    replicas: list[Any],
    holder: bool = True,
    status: Obj | None = None,
    fleet: Fleet | None = None,
    state: EngineState | None = None,
) -> tuple[Waiting | None, EngineState]:
    state = state or EngineState((pools.namespace, "eng"), admin_key="k")
    state.renders[root_uid] = Render(2, 0, "h")
    fleet = fleet or Fleet()
    held = Holder(state, replicas, 8080) if holder else None

    async def body(kube: Kube) -> Waiting | None:
        async with httpx.AsyncClient(transport=FakeFleet(engines).transport()) as http:
            return await finalize_pool(
                pools.namespace, "root", root_uid, pools.live, held, http, kube, status, fleet,
                0.05,
            )  # fmt: skip

    return as_operator(cluster, kubeconfig, body), state


def test_children_are_deleted_first_and_waited_for(
    k8s_cluster: ControlPlane, operator_kubeconfig: Path, pools: Pools
) -> None:
    root = pools.create("root")
    pools.create("a", parent="root")
    pools.create("b", parent="root", hold=True)
    pools.delete("b")
    b_before = pools.get("b")["metadata"]
    assert b_before.get("deletionTimestamp")

    waiting, _ = finalize(k8s_cluster, operator_kubeconfig, pools, root, {}, [])
    # `a` was deleted with the operator's credentials; `b`, deleting already, was left to
    # its own finalizer (not deleted again), and the root waits for it.
    assert pools.get_or_none("a") is None
    assert pools.get("b")["metadata"]["resourceVersion"] == b_before["resourceVersion"]
    assert waiting is not None and waiting.message.endswith(": b") and waiting.delay == 1
    busy = {c["type"]: c for c in waiting.status_patch["conditions"]}["Reconciling"]
    assert busy["reason"] == "DeletingChildren"
    # The same conditions again are no news: nothing to patch.
    again, _ = finalize(
        k8s_cluster, operator_kubeconfig, pools, root, {}, [],
        status={"conditions": waiting.status_patch["conditions"]},
    )  # fmt: skip
    assert again is not None and again.status_patch == {}
    assert pools.get("root")["metadata"].get("deletionTimestamp") is None


def test_a_pool_released_everywhere_is_forgotten(
    k8s_cluster: ControlPlane, operator_kubeconfig: Path, pools: Pools
) -> None:
    root = pools.create("root")
    eng = with_pools("root")
    waiting, state = finalize(
        k8s_cluster, operator_kubeconfig, pools, root, {"10.0.0.1": eng}, [pod("a", "10.0.0.1")]
    )
    assert waiting is None and eng.pools == {}
    assert root not in state.renders
    assert state.deleting == {root}  # until the object is gone: no round re-creates it


def test_without_an_engine_the_pool_goes(
    k8s_cluster: ControlPlane, operator_kubeconfig: Path, pools: Pools
) -> None:
    root = pools.create("root")
    before = pools.get("root")["metadata"]["resourceVersion"]
    waiting, _ = finalize(k8s_cluster, operator_kubeconfig, pools, root, {}, [], holder=False)
    assert waiting is None
    assert pools.get("root")["metadata"]["resourceVersion"] == before  # nothing written


def test_a_replica_that_does_not_answer_keeps_the_finalizer(
    k8s_cluster: ControlPlane, operator_kubeconfig: Path, pools: Pools
) -> None:
    root = pools.create("root")
    down = with_pools("root")
    down.down = True
    waiting, state = finalize(
        k8s_cluster, operator_kubeconfig, pools, root, {"10.0.0.1": down}, [pod("a", "10.0.0.1")]
    )
    assert waiting is not None and "does not answer" in waiting.message
    ready = {c["type"]: c for c in waiting.status_patch["conditions"]}["Ready"]
    assert ready["status"] == "Unknown" and ready["reason"] == "EngineUnreachable"
    assert state.deleting == {root}


def test_a_parent_goes_on_as_soon_as_its_children_are_released(
    k8s_cluster: ControlPlane, operator_kubeconfig: Path, pools: Pools
) -> None:
    """One step per tree level: no retry back-off between a child's release and its
    parent's."""
    root = pools.create("root")
    child = pools.create("a", parent="root", hold=True)
    pools.delete("a")
    eng = with_pools("root")
    fleet = Fleet()
    state = EngineState((pools.namespace, "eng"), admin_key="k")

    async def body(kube: Kube) -> tuple[Waiting | None, float]:
        async with httpx.AsyncClient(transport=FakeFleet({"10.0.0.1": eng}).transport()) as http:
            held = Holder(state, [pod("p", "10.0.0.1")], 8080)
            t0 = time.monotonic()
            parent = asyncio.create_task(
                finalize_pool(
                    pools.namespace, "root", root, pools.live, held, http, kube, None, fleet, 30
                )
            )
            await asyncio.sleep(0.1)
            assert not parent.done()  # waiting for "a"
            await fleet.mark_released(child, {root, child})
            return await parent, time.monotonic() - t0

    waiting, took = as_operator(k8s_cluster, operator_kubeconfig, body)
    assert waiting is None and eng.pools == {} and took < 10  # not the 30 s wait
    assert {root, child} <= fleet.released


def test_a_release_refused_again_and_again_turns_stalled(
    k8s_cluster: ControlPlane, operator_kubeconfig: Path, pools: Pools
) -> None:
    root = pools.create("root")
    eng = with_pools("root", "agent-fork", parent="root")  # a fork the engine holds, not ours
    state = EngineState((pools.namespace, "eng"), admin_key="k")
    fleet = Fleet()
    reasons = []
    for _ in range(3):
        waiting, _ = finalize(
            k8s_cluster, operator_kubeconfig, pools, root, {"10.0.0.1": eng},
            [pod("a", "10.0.0.1")], fleet=fleet, state=state,
        )  # fmt: skip
        assert waiting is not None
        conds = {c["type"]: c for c in waiting.status_patch["conditions"]}
        reasons.append((conds["Stalled"]["status"], conds["Ready"]["reason"]))
    assert reasons == [
        ("False", "ReleaseRefused"),
        ("False", "ReleaseRefused"),
        ("True", "ReleaseRefused"),
    ]
    assert "remove the finalizer by hand" in waiting.message and "child pools" in waiting.message
