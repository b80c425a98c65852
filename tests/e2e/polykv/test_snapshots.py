"""Pools that survive on Kubernetes: a killed engine comes back with its tree restored from
its snapshot store (an emptyDir outlives the container), a scale-up replica fetches the
tree from a Ready peer, a rollout's new pod fetches it from the old one, and a pod deleted
outright restores from a claim that outlives it.

Real control plane and operator, engine pods as local processes. Each test reads, on the
engines themselves, how every pool's cells came to be (``materialized_from``) and checks
the statuses the operator writes from it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from polykv_testenv import ControlPlane, ProcessNode
from polykv_testenv.claims import bind_claim

from ..helpers import Obj, eventually
from .test_operator import (
    EngineApi,
    Operator,
    Replica,
    apply,
    engine_manifest,
    get,
    replicas,
    tree_manifests,
    wait_condition,
)

pytestmark = pytest.mark.k8s

TREE = ("crew", "planner", "shell")


def ready_tree(cluster: ControlPlane, namespace: str, engine: Obj) -> EngineApi:
    apply(cluster, namespace, engine, *tree_manifests())
    for name in TREE:
        wait_condition(cluster, namespace, "polykvpools", name, "Ready")
    return EngineApi(cluster, namespace)


def sources(eng: EngineApi, ip: str, after: float) -> dict[str, str] | None:
    """How each pool of the tree came to be on the replica at ``ip``, once all of them are
    there and were created after ``after`` (a new engine process)."""
    pools = eng.pools_or_none(ip)
    if pools is None or not all(n in pools and pools[n].created_ts > after for n in TREE):
        return None
    if any(pools[n].residency != "resident" for n in TREE):
        return None
    return {n: pools[n].materialized_from for n in TREE}


def engine_totals(cluster: ControlPlane, namespace: str) -> Obj | None:
    snaps: Obj | None = get(cluster, namespace, "polykvengines", "eng")["status"].get("snapshots")
    return snaps


def pool_sources(cluster: ControlPlane, namespace: str) -> set[str | None]:
    found = set()
    for name in TREE:
        for row in get(cluster, namespace, "polykvpools", name)["status"].get("replicas") or []:
            found.add(row.get("materializedFrom"))
    return found


def written(eng: EngineApi, ip: str, n: int) -> bool | None:
    """The replica's store holds the tree's snapshots (its writer thread is done)."""
    r = httpx.get(f"http://{ip}:8080/polykv/pools", headers=eng.headers, timeout=10)
    files = (r.json()["snapshots"] or {}).get("files", 0) if r.status_code == 200 else 0
    return True if files >= n else None


def other_replica(cluster: ControlPlane, namespace: str, rep: Replica) -> Replica | None:
    return next((r for r in replicas(cluster, namespace) if r.pod != rep.pod), None)


def totals_with(cluster: ControlPlane, namespace: str, restored: int) -> Obj | None:
    """The engine's snapshot totals once they count ``restored`` pools."""
    totals = engine_totals(cluster, namespace)
    return totals if totals is not None and totals.get("restored") == restored else None


def test_a_killed_engine_restores_its_tree_then_a_new_replica_fetches_it_from_a_peer(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str, operator: Operator
) -> None:
    eng = ready_tree(k8s_cluster, namespace, engine_manifest())
    (rep,) = replicas(k8s_cluster, namespace)
    eventually("snapshots written", lambda: written(eng, rep.ip, len(TREE)), 60)

    # The engine process dies; the pod and its emptyDir stay; the container restarts.
    pid = process_node.pid(namespace, rep.pod)
    assert pid is not None
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    got = eventually("the tree back", lambda: sources(eng, rep.ip, killed_at), 120)
    assert got == dict.fromkeys(TREE, "store")
    eventually("3 restored in the engine's status", lambda: totals_with(k8s_cluster, namespace, 3))
    eventually(
        "pool statuses say store",
        lambda: True if pool_sources(k8s_cluster, namespace) == {"store"} else None,
    )

    # Scale up: the new pod's store is empty; the operator names the Ready replica as peer.
    scaled_at = time.time()
    k8s_cluster.kubectl("scale", "polykvengine/eng", "--replicas=2", "-n", namespace)
    new = eventually("a second replica", lambda: other_replica(k8s_cluster, namespace, rep), 120)
    got = eventually("the tree on the new replica", lambda: sources(eng, new.ip, scaled_at), 120)
    assert got == dict.fromkeys(TREE, "peer")
    wait_condition(k8s_cluster, namespace, "polykvengines", "eng", "Ready")
    totals = eventually("6 restored over 2", lambda: totals_with(k8s_cluster, namespace, 6))
    assert totals["rebuilt"] == 0 and totals["bytes"] > 0


def test_a_rollout_fills_the_new_pod_from_the_old_one(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    eng = ready_tree(k8s_cluster, namespace, engine_manifest())
    (rep,) = replicas(k8s_cluster, namespace)
    eventually("snapshots written", lambda: written(eng, rep.ip, len(TREE)), 60)
    # A new pod template: the Deployment surges one pod while the old one stays Ready.
    rolled_at = time.time()
    patch = '{"spec":{"podLabels":{"rollout":"2"}}}'
    k8s_cluster.kubectl("patch", "polykvengine/eng", "-n", namespace, "--type=merge", "-p", patch)
    new = eventually("a new pod", lambda: other_replica(k8s_cluster, namespace, rep), 120)
    got = eventually("the tree on the new pod", lambda: sources(eng, new.ip, rolled_at), 120)
    assert got == dict.fromkeys(TREE, "peer")
    eventually(
        "the old pod gone",
        lambda: True if [r.pod for r in replicas(k8s_cluster, namespace)] == [new.pod] else None,
        120,
    )
    wait_condition(k8s_cluster, namespace, "polykvengines", "eng", "Ready")


@pytest.fixture
def claim(k8s_cluster: ControlPlane, namespace: str) -> Iterator[str]:
    """A claim bound to a volume of its own; the process node keeps its files in a
    directory that outlives the pods."""
    pv = bind_claim(k8s_cluster, namespace, "snaps")
    yield "snaps"
    k8s_cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


def tree_on_claim(cluster: ControlPlane, namespace: str, claim: str) -> tuple[EngineApi, Replica]:
    """One engine replica keeping its snapshots on ``claim``, its tree Ready and written."""
    engine = engine_manifest()
    engine["spec"]["snapshots"] = {
        "volume": {"persistentVolumeClaim": {"claimName": claim}},
        "sizeMib": 64,
    }
    eng = ready_tree(cluster, namespace, engine)
    (rep,) = replicas(cluster, namespace)
    eventually("snapshots written", lambda: written(eng, rep.ip, len(TREE)), 60)
    return eng, rep


def test_a_deleted_pod_restores_from_a_claim_that_outlives_it(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator, claim: str
) -> None:
    eng, rep = tree_on_claim(k8s_cluster, namespace, claim)
    deleted_at = time.time()
    k8s_cluster.kubectl("delete", "pod", rep.pod, "-n", namespace, "--wait=false")
    new = eventually("a new pod", lambda: other_replica(k8s_cluster, namespace, rep), 120)
    got = eventually("the tree on the new pod", lambda: sources(eng, new.ip, deleted_at), 120)
    assert got == dict.fromkeys(TREE, "store")
    wait_condition(k8s_cluster, namespace, "polykvengines", "eng", "Ready")


def test_snapshots_moved_from_a_claim_to_an_emptydir_roll_the_pod(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator, claim: str
) -> None:
    """A volume patched into the Deployment by name keeps the fields the new one leaves out
    unless told otherwise: a claim and an emptyDir in one volume, refused by the API
    server, and the engine stuck on its old pod template."""
    engine = engine_manifest()
    engine["spec"]["snapshots"] = {"volume": {"persistentVolumeClaim": {"claimName": claim}}}
    apply(k8s_cluster, namespace, engine)
    wait_condition(k8s_cluster, namespace, "polykvengines", "eng", "Ready")
    patch = '{"spec":{"snapshots":{"volume":null}}}'
    k8s_cluster.kubectl("patch", "polykvengine/eng", "-n", namespace, "--type=merge", "-p", patch)

    def snapshot_volume() -> Obj | None:
        path = f"/apis/apps/v1/namespaces/{namespace}/deployments/eng"
        volumes = k8s_cluster.api.get(path)["spec"]["template"]["spec"]["volumes"]
        vol: Obj = next(v for v in volumes if v["name"] == "snapshots")
        return vol if "persistentVolumeClaim" not in vol else None

    vol = eventually("the snapshots volume an emptyDir", snapshot_volume, 90)
    assert set(vol) == {"name", "emptyDir"}
    wait_condition(k8s_cluster, namespace, "polykvengines", "eng", "Ready")


def test_a_sessions_context_outlives_its_deleted_pod_on_a_claim(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator, claim: str
) -> None:
    """A session's cache is written at SIGTERM into the claim; the new pod restores it at
    the session's next turn."""
    eng, rep = tree_on_claim(k8s_cluster, namespace, claim)
    headers = {**eng.headers, "x-session-id": "agent-7"}
    prompt = [(i * 389) % 900 + 5 for i in range(160)]

    def turn(ip: str, tokens: list[int]) -> Obj:
        body = {"prompt": tokens, "n_predict": 6, "temperature": 0}
        r = httpx.post(f"http://{ip}:8080/completion", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        out: Obj = r.json()
        return out

    nxt = prompt + turn(rep.ip, prompt)["tokens"] + [11, 12, 13]
    deleted_at = time.time()
    k8s_cluster.kubectl("delete", "pod", rep.pod, "-n", namespace, "--wait=false")
    new = eventually("a new pod", lambda: other_replica(k8s_cluster, namespace, rep), 120)
    eventually("the tree on the new pod", lambda: sources(eng, new.ip, deleted_at), 120)
    r = httpx.get(f"http://{new.ip}:8080/polykv/sessions/agent-7", headers=headers, timeout=10)
    assert r.status_code == 200 and r.json()["kv"] == "stored", r.text
    assert turn(new.ip, nxt)["timings"]["cache_n"] >= len(prompt)
