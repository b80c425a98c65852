"""The operator under faults, on the real control plane with real engines: SIGKILLed at
every handler step, down while resources change, the API server gone for a minute, its
watches cut (and answered 410 Gone), two replicas at once, other writers on its status, a
release the engine keeps refusing, and trees deleted with both cascade policies.

Each test states the figure it proves in its docstring; docs/reliability.md's table
repeats them."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from polykv_operator.faults import POINTS
from polykv_testenv import ControlPlane, ProcessNode
from polykv_testenv.tcpproxy import TcpProxy

from ..helpers import Obj, condition, eventually, gone
from .test_operator import (
    EngineApi,
    Operator,
    PodWatch,
    apply,
    engine_manifest,
    gate_of,
    get,
    is_pod,
    no_pools,
    obj_path,
    pool_manifest,
    reason,
    replicas,
    tree_manifests,
    wait_condition,
)

pytestmark = pytest.mark.k8s

POLICY = {
    "apiVersion": "polykv.io/v1alpha1",
    "kind": "AdmissionPolicy",
    "metadata": {"name": "floor"},
    "spec": {"poolSelector": {"matchLabels": {"tier": "interactive"}}, "targetTpsPerSession": 3},
}
DELETE_POINTS = ("children-deleted", "pool-released", "pool-forgotten")


def turn(text: str) -> Obj:
    return {"role": "user", "content": text}


def subtree(i: int) -> list[Obj]:
    """A child of "root" (selected by the policy) and a grandchild."""
    return [
        pool_manifest(
            f"a{i}",
            parent="root",
            appendMessages=[turn(f"Task {i}.")],
            labels={"tier": "interactive"},
        ),
        pool_manifest(f"b{i}", parent=f"a{i}", appendMessages=[turn("Go on.")]),
    ]


def converged(
    cluster: ControlPlane,
    namespace: str,
    declared: set[str],
    gone_names: set[str] = frozenset(),
    policy: bool = False,
) -> dict[str, dict[str, Any]]:
    """Every declared pool Ready with one entry per replica that matches the engine, and
    each replica holding exactly the declared pools: none duplicated, lost or leaked; with
    `policy`, POLICY pushed to the "a" pools. Returns pod -> pool name -> pool id."""
    try:
        for name in sorted(declared):
            wait_condition(cluster, namespace, "polykvpools", name, "Ready", 120)
    except Exception:
        for p in cluster.api.get(obj_path(namespace, "polykvpools"))["items"]:
            print(p["metadata"]["name"], p["metadata"].get("resourceVersion"), p.get("status"))
        raise
    for name in gone_names:
        path = obj_path(namespace, "polykvpools", name)
        eventually(f"{name} gone", lambda p=path: gone(cluster.api, p), 90)  # type: ignore[misc]
    api = EngineApi(cluster, namespace)
    out: dict[str, dict[str, Any]] = {}
    for rep in replicas(cluster, namespace):

        def exact(ip: str = rep.ip) -> dict[str, Any] | None:
            pools = api.pools_or_none(ip)
            return pools if pools is not None and set(pools) == declared else None

        pools = eventually(f"{rep.pod} holds exactly the declared pools", exact, 60)
        ids = [p.pool_id for p in pools.values()]
        assert len(ids) == len(set(ids)), pools  # no duplicate
        out[rep.pod] = {n: p.pool_id for n, p in pools.items()}
        if policy:
            assert all(pools[n].admission is not None for n in declared if n.startswith("a"))

    def listed() -> bool | None:  # each pool's status names every replica and its pool id
        for name in declared:
            st = get(cluster, namespace, "polykvpools", name)["status"]
            rows = {r["pod"]: r["poolId"] for r in st.get("replicas") or []}
            if rows != {pod: ids[name] for pod, ids in out.items()}:
                return None
        return True

    eventually("every status lists every replica's pool id", listed, 60)
    return out


@pytest.mark.slow
def test_sigkill_at_every_handler_step_leaves_nothing_duplicated_lost_or_leaked(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str, operator: Operator
) -> None:
    """Figure: the operator SIGKILLed once at each of the 15 handler steps (faults.POINTS),
    with creates, evictions, policy pushes, gate changes, status writes and deletes in
    flight: 0 duplicated, 0 lost, 0 leaked pools; pools that survived a crash kept their
    engine pool id (adopted, not re-created)."""
    engine = engine_manifest()
    engine["spec"]["maxPools"] = 4  # five pools at a time: one eviction per step
    apply(k8s_cluster, namespace, engine, pool_manifest("root", messages=[ROOT_MSG]), POLICY)
    declared = {"root"}
    before = converged(k8s_cluster, namespace, declared, policy=True)
    for i, point in enumerate(POINTS):
        operator.stop()
        operator.start(POLYKV_OPERATOR_CRASH_AT=f"{point}:1")
        apply(k8s_cluster, namespace, *subtree(i))
        previous = {f"a{i - 1}", f"b{i - 1}"} if i else set()
        if point in DELETE_POINTS and previous:
            k8s_cluster.kubectl("delete", f"polykvpool/a{i - 1}", "-n", namespace, "--wait=false")
        if point == "gate-written":
            (rep,) = replicas(k8s_cluster, namespace)
            pid = process_node.pid(namespace, rep.pod)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        eventually(
            f"operator SIGKILLed at {point}",
            lambda: True if not operator.alive() else None,
            120,
        )
        assert f"crash point {point} reached" in operator.runs[-1].log(), point
        operator.start()
        if previous and point not in DELETE_POINTS:
            k8s_cluster.kubectl("delete", f"polykvpool/a{i - 1}", "-n", namespace, "--wait=false")
        declared = (declared - previous) | {f"a{i}", f"b{i}"}
        after = converged(k8s_cluster, namespace, declared, previous, policy=True)
        if point != "gate-written":  # the engine itself restarted there: all new ids
            for pod, ids in after.items():
                for name, pool_id in before.get(pod, {}).items():
                    if name in ids:
                        assert ids[name] == pool_id, (point, name)  # adopted
        before = after
    k8s_cluster.kubectl("delete", "polykvpool/root", "-n", namespace, "--wait=false")
    eventually("every pool gone", lambda: no_pools(k8s_cluster, namespace), 120)
    api = EngineApi(k8s_cluster, namespace)
    assert all(api.pools(r.ip) == {} for r in replicas(k8s_cluster, namespace))


ROOT = "You are the research crew. Cite sources, be brief."
ROOT_MSG = {"role": "system", "content": ROOT}


def test_changes_while_the_operator_is_down_are_all_reconciled(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    """Figure: with the operator stopped, 3 pools created, 1 relabelled into a policy, 1
    policy created and a 2-pool subtree deleted; on start all 6 changes are applied: every
    declared pool Ready, the policy pushed, the deleted pools off the engine (0 orphans)."""
    apply(k8s_cluster, namespace, engine_manifest(), pool_manifest("root", messages=[ROOT_MSG]))
    apply(k8s_cluster, namespace, *subtree(0), pool_manifest("plain", text="Plain root."))
    converged(k8s_cluster, namespace, {"root", "a0", "b0", "plain"})
    operator.stop()
    apply(k8s_cluster, namespace, *subtree(1), pool_manifest("late", text="A late root."))
    k8s_cluster.kubectl("label", "polykvpool/plain", "tier=interactive", "-n", namespace)
    apply(k8s_cluster, namespace, POLICY)
    k8s_cluster.kubectl("delete", "polykvpool/a0", "-n", namespace, "--wait=false")
    obj = get(k8s_cluster, namespace, "polykvpools", "a0")
    assert obj["metadata"].get("deletionTimestamp")  # held by our finalizer meanwhile
    operator.start()
    converged(
        k8s_cluster, namespace, {"root", "a1", "b1", "plain", "late"}, {"a0", "b0"}, policy=True
    )
    api = EngineApi(k8s_cluster, namespace)
    (rep,) = replicas(k8s_cluster, namespace)
    assert api.pools(rep.ip)["plain"].admission is not None  # the relabel took effect
    wait_condition(k8s_cluster, namespace, "admissionpolicies", "floor", "Ready", 60)


def test_an_engine_that_restarted_while_the_operator_was_down_leaves_service_first(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str, operator: Operator
) -> None:
    """Figure: the engine SIGKILLed and back (Ready, gate still True, KV empty) before the
    operator starts again: the new operator drops the gate (EngineRestarted, told by the
    boot its gate message names) and raises it only once all 3 pools are back."""
    apply(k8s_cluster, namespace, engine_manifest(), *tree_manifests())
    names = {"crew", "planner", "shell"}
    converged(k8s_cluster, namespace, names)
    (rep,) = replicas(k8s_cluster, namespace)
    operator.stop()
    pid = process_node.pid(namespace, rep.pod)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)

    def back() -> Obj | None:  # the new engine serves, the stale gate still says True
        pod = k8s_cluster.api.get(f"/api/v1/namespaces/{namespace}/pods/{rep.pod}")
        (c,) = pod["status"]["containerStatuses"]
        return pod if c["restartCount"] == rep.restarts + 1 and c.get("ready") else None

    assert gate_of(eventually("engine container back", back, 90)) == "True"
    eng = EngineApi(k8s_cluster, namespace)
    assert eng.pools(rep.ip) == {}
    watch = PodWatch(k8s_cluster, namespace)
    started = time.time()
    # Order, not clocks: each sample reads the gate, then the engine's pools. Once the gate
    # has dropped, a True gate read before a listing means that listing (taken after it,
    # and pools only come back) holds every pool: the gate went up only after all of them.
    samples: list[tuple[str | None, set[str] | None]] = []
    stop = threading.Event()

    def sample() -> None:
        pod_path = f"/api/v1/namespaces/{namespace}/pods/{rep.pod}"
        while not stop.is_set():
            gate = gate_of(k8s_cluster.api.get(pod_path))
            listed = eng.pools_or_none(rep.ip)
            samples.append((gate, None if listed is None else set(listed)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    operator.start()

    def dropped_then_raised() -> tuple[float, float] | None:
        down = watch.first(lambda o: is_pod(rep.uid)(o) and gate_of(o) == "False", started)
        up = down and watch.first(lambda o: is_pod(rep.uid)(o) and gate_of(o) == "True", down)
        return (down, up) if down and up else None

    eventually("gate dropped, then raised", dropped_then_raised, 120)
    eventually(
        "a sample of the raised gate",
        lambda: (
            True if any(g == "False" for g, _ in samples) and samples[-1][0] == "True" else None
        ),
        60,
    )
    stop.set()
    sampler.join(timeout=30)
    watch.stop()
    after_drop = samples[next(i for i, (g, _) in enumerate(samples) if g == "False") :]
    raised = [listed for gate, listed in after_drop if gate == "True"]
    assert raised and all(listed == names for listed in raised), raised
    print(f"{len(samples)} samples, {len(raised)} with the gate raised again")
    assert set(eng.pools(rep.ip)) == names
    assert "reason=EngineRestarted" in operator.runs[-1].log()


@pytest.mark.slow
def test_api_server_down_for_a_minute(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    """Figure: kube-apiserver stopped for 60 s under a running operator: the operator
    process survives (same pid), releases nothing on the engines meanwhile, and after the
    restart a pool applied is Ready and every status is whole (observedGeneration and all
    three conditions on each pool)."""
    apply(k8s_cluster, namespace, engine_manifest(), pool_manifest("root", messages=[ROOT_MSG]))
    apply(k8s_cluster, namespace, *subtree(0))
    converged(k8s_cluster, namespace, {"root", "a0", "b0"})
    api = EngineApi(k8s_cluster, namespace)
    (rep,) = replicas(k8s_cluster, namespace)
    held = api.pools(rep.ip)
    pid = operator.runs[-1].proc.pid
    k8s_cluster.stop_component("kube-apiserver")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the outage itself, watched, not a wait
            assert operator.alive(), "the operator died while the API server was down"
            assert {n: p.pool_id for n, p in api.pools(rep.ip).items()} == {
                n: p.pool_id for n, p in held.items()
            }
            time.sleep(1)
    finally:
        restarting = datetime.now()
        k8s_cluster.start_component("kube-apiserver")  # returns once /readyz says ok
        operator.forbidden_ok.append((restarting, datetime.now()))
    apply(k8s_cluster, namespace, *subtree(1))
    converged(k8s_cluster, namespace, {"root", "a0", "b0", "a1", "b1"})
    assert operator.alive() and operator.runs[-1].proc.pid == pid
    for name in ("root", "a0", "b0", "a1", "b1"):
        st = get(k8s_cluster, namespace, "polykvpools", name)["status"]
        assert st["observedGeneration"] == 1
        assert {c["type"] for c in st["conditions"]} == {"Ready", "Reconciling", "Stalled"}


def proxied_kubeconfig(original: Path, proxy: TcpProxy, into: Path) -> Path:
    config = yaml.safe_load(original.read_text())
    config["clusters"][0]["cluster"]["server"] = proxy.url
    into.write_text(yaml.safe_dump(config))
    return into


def test_watches_cut_and_410_gone_then_every_change_handled(
    k8s_cluster: ControlPlane,
    namespace: str,
    operator: Operator,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> None:
    """Figure: the operator's connections to the API server cut (watches closed mid-stream)
    while 4 pools are created and a 2-pool subtree deleted, then the API server restarted so
    that the operator's resourceVersion is too old (410 Gone): it re-lists, and all 6 changes
    are applied; no event-driven drift."""
    with TcpProxy(k8s_cluster.ports.apiserver) as proxy:
        operator.stop()
        operator.start(kubeconfig=proxied_kubeconfig(operator_kubeconfig, proxy, tmp_path / "kc"))
        apply(k8s_cluster, namespace, engine_manifest(), pool_manifest("root", messages=[ROOT_MSG]))
        apply(k8s_cluster, namespace, *subtree(0))
        converged(k8s_cluster, namespace, {"root", "a0", "b0"})
        proxy.cut()
        apply(k8s_cluster, namespace, *subtree(1), *subtree(2))
        k8s_cluster.kubectl("delete", "polykvpool/a0", "-n", namespace, "--wait=false")
        # A fresh watch cache starts at the current revision: the operator's last one is
        # now too old, and its next watch is answered 410 Gone.
        k8s_cluster.restart_component("kube-apiserver")
        proxy.restore()
        converged(k8s_cluster, namespace, {"root", "a1", "b1", "a2", "b2"}, {"a0", "b0"})
        assert proxy.cuts == 1 and operator.alive()
        assert "Restarting the watch-stream" in operator.log()  # kopf's answer to a 410


def test_two_operators_with_peering_only_one_acts_and_the_other_takes_over(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    """Figure: two operator processes with kopf peering: 1 acts (every engine call in its
    log, none in the other's); the leader SIGKILLed, the other takes over and materializes a
    new pool within the peering lifetime (20 s) plus a round."""
    peering = str(Path(__file__).parents[3] / "operator" / "deploy" / "peering.yaml")
    eventually(  # the CRDs at once; the ClusterKopfPeering once they are served
        "peering CRDs and object applied",
        lambda: (
            True
            if k8s_cluster.kubectl("apply", "-f", peering, check=False).returncode == 0
            else None
        ),
        60,
    )
    apply(
        k8s_cluster,
        namespace,
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "polykv"}},
    )
    operator.stop()
    high = operator.start(peering="polykv", POLYKV_OPERATOR_PRIORITY="200").runs[-1]
    low = Operator(operator.cluster, namespace, operator.kubeconfig, tmp_path / "low")
    (tmp_path / "low").mkdir()
    low.start(peering="polykv", POLYKV_OPERATOR_PRIORITY="100")
    peers = f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/polykv"
    try:
        eventually(
            "both operators keep the peering alive",
            lambda: True if len(k8s_cluster.api.get(peers).get("status") or {}) == 2 else None,
            60,
        )
        apply(k8s_cluster, namespace, engine_manifest(), pool_manifest("root", messages=[ROOT_MSG]))
        apply(k8s_cluster, namespace, *subtree(0))
        converged(k8s_cluster, namespace, {"root", "a0", "b0"})
        assert "pool materialized" in high.log() and "pool materialized" not in low.log()
        high.kill()
        killed = time.monotonic()
        apply(k8s_cluster, namespace, *subtree(1))
        # The deadline is converged's own wait: no bound on the measured time.
        converged(k8s_cluster, namespace, {"root", "a0", "b0", "a1", "b1"})
        took = time.monotonic() - killed
        assert "Resuming operations" in low.log() or "pool materialized" in low.log()
        assert "pool materialized ns=" in low.log()
        print(f"failover: new pool Ready {took:.1f}s after the leader's SIGKILL")
    finally:
        low.stop_all()


def test_other_status_writers_are_corrected(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    """Figure: 10 overwrites of pool and engine status by another writer (stale replica
    lists, a false Ready, a dropped condition), interleaved with the operator's own writes:
    every one corrected within a round; 0 entries lost (conditions, per-replica ids)."""
    apply(k8s_cluster, namespace, engine_manifest(), pool_manifest("root", messages=[ROOT_MSG]))
    apply(k8s_cluster, namespace, *subtree(0))
    truth = converged(k8s_cluster, namespace, {"root", "a0", "b0"})
    base = obj_path(namespace, "polykvpools")
    bogus = [
        {"replicas": [{"pod": "nobody", "poolId": 999, "bootId": "x"}]},
        {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "Forged",
                    "message": "",
                    "lastTransitionTime": "2020-01-01T00:00:00Z",
                }
            ]
        },
        {"path": "elsewhere", "depth": 7},
    ]
    for k in range(10):
        name = ("root", "a0", "b0")[k % 3]
        k8s_cluster.api.patch(f"{base}/{name}/status", {"status": bogus[k % 3]})
        if k % 5 == 4:
            k8s_cluster.api.patch(
                obj_path(namespace, "polykvengines", "eng") + "/status",
                {"status": {"readyReplicas": 0, "replicaStatus": []}},
            )
    converged(k8s_cluster, namespace, {"root", "a0", "b0"})

    def whole() -> bool | None:
        for name in ("root", "a0", "b0"):
            st = get(k8s_cluster, namespace, "polykvpools", name)["status"]
            pod, ids = next(iter(truth.items()))
            if [(r["pod"], r["poolId"]) for r in st.get("replicas") or []] != [(pod, ids[name])]:
                return None
            if len(st["conditions"]) != 3 or st["path"].split("/")[-1] != name:
                return None
        eng = get(k8s_cluster, namespace, "polykvengines", "eng")["status"]
        return True if eng["readyReplicas"] == 1 and len(eng["replicaStatus"]) == 1 else None

    eventually("every overwrite corrected", whole, 30)


def test_a_release_the_engine_refuses_turns_stalled_and_orphans_are_reported(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    """Figure: a declared pool with an agent-made fork under it, deleted: Stalled=True with
    reason ReleaseRefused and the escape hatch in the message within 3 refusals; the fork
    released by the agent, the pool goes. An agent-made pinned pool shows in the engine's
    status (orphanedPins) and in polykv_engine_orphaned_pins."""
    apply(k8s_cluster, namespace, engine_manifest(), pool_manifest("root", text=ROOT))
    wait_condition(k8s_cluster, namespace, "polykvpools", "root", "Ready")
    api = EngineApi(k8s_cluster, namespace)
    (rep,) = replicas(k8s_cluster, namespace)
    fork = httpx.post(
        f"http://{rep.ip}:8080/polykv/pools/root/fork",
        json={"name": "agent-fork", "prompt": ROOT + " and a tangent"},
        headers=api.headers,
        timeout=60,
    )
    assert fork.status_code in (200, 201), fork.text
    api.create(rep.ip, {"name": "agent-pin", "prompt": "Somebody's scratch.", "pin": True})

    def orphan_reported() -> Obj | None:
        st = get(k8s_cluster, namespace, "polykvengines", "eng")["status"]
        row = (st.get("replicaStatus") or [{}])[0]
        return row if row.get("orphanedPins") == ["agent-pin"] else None

    row = eventually("orphaned pin in the engine status", orphan_reported, 30)
    assert row["unmanagedPools"] == 2
    scraped = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=10).text
    assert f'polykv_engine_orphaned_pins{{engine="eng",namespace="{namespace}"}} 1.0' in scraped
    k8s_cluster.kubectl("delete", "polykvpool/root", "-n", namespace, "--wait=false")
    obj = wait_condition(k8s_cluster, namespace, "polykvpools", "root", "Stalled", 60)
    got, message = reason(obj, "Stalled")
    assert got == "ReleaseRefused" and "remove the finalizer by hand" in message, message
    released = httpx.delete(
        f"http://{rep.ip}:8080/polykv/pools/agent-fork", headers=api.headers, timeout=30
    )
    assert released.status_code == 200, released.text
    root = obj_path(namespace, "polykvpools", "root")
    eventually("released once the engine agrees", lambda: gone(k8s_cluster.api, root), 60)
    assert set(api.pools(rep.ip)) == {"agent-pin"}


def tree_manifests_3_levels(n_children: int, n_leaves: int) -> list[Obj]:
    out = [pool_manifest("t", messages=[ROOT_MSG])]
    for c in range(n_children):
        out.append(pool_manifest(f"t{c}", parent="t", appendMessages=[turn(f"Branch {c}.")]))
        for leaf in range(n_leaves):
            leaf_turn = [turn(f"Leaf {leaf}.")]
            out.append(pool_manifest(f"t{c}-{leaf}", parent=f"t{c}", appendMessages=leaf_turn))
    return out


@pytest.mark.parametrize("cascade", ["background", "foreground"])
def test_a_tree_deletes_leaves_first_in_one_step_per_level(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator, cascade: str
) -> None:
    """Figure: a 3-level, 13-pool tree on 2 replicas deleted with --cascade=background and
    --cascade=foreground: gone from the API and both engines, leaves released before their
    parents, in seconds (time printed; well under the 60 s a retry back-off would take)."""
    engine = engine_manifest(replicas=2)
    engine["spec"]["maxPools"] = 16
    tree = tree_manifests_3_levels(3, 3)
    apply(k8s_cluster, namespace, engine, *tree)
    names = {t["metadata"]["name"] for t in tree}
    converged(k8s_cluster, namespace, names)
    t0 = time.monotonic()
    k8s_cluster.kubectl(
        "delete", "polykvpool/t", "-n", namespace, f"--cascade={cascade}", "--wait=false"
    )
    eventually("every pool gone", lambda: no_pools(k8s_cluster, namespace), 120)
    took = time.monotonic() - t0
    api = EngineApi(k8s_cluster, namespace)
    assert all(api.pools(r.ip) == {} for r in replicas(k8s_cluster, namespace))
    order = re.findall(r"pool release ns=\S+ engine=eng pool=(\S+) released=\['", operator.log())
    for c in range(3):
        assert order.index(f"t{c}") < order.index("t")
        for leaf in range(3):
            assert order.index(f"t{c}-{leaf}") < order.index(f"t{c}")
    print(f"{cascade}: 13-pool tree on 2 replicas deleted in {took:.1f}s")
    assert took < 45


def test_operator_counters_only_grow(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    """Figure: 6 scrapes of the operator's /metrics around creates, a delete and an engine
    restart: every counter (and histogram count/sum) is non-decreasing between scrapes."""
    url = f"http://127.0.0.1:{operator.metrics_port}/metrics"

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            if fam.type not in ("counter", "histogram"):
                continue
            for s in fam.samples:
                if s.name.endswith(("_total", "_count", "_sum", "_bucket")):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    scrapes = [eventually("metrics served", scrape, 30)]
    apply(k8s_cluster, namespace, engine_manifest(), pool_manifest("root", messages=[ROOT_MSG]))
    for step in range(5):
        if step == 1:
            apply(k8s_cluster, namespace, *subtree(0))
            converged(k8s_cluster, namespace, {"root", "a0", "b0"})
        elif step == 3:
            k8s_cluster.kubectl("delete", "polykvpool/a0", "-n", namespace, "--wait=false")
            converged(k8s_cluster, namespace, {"root"}, {"a0", "b0"})
        else:
            wait_condition(k8s_cluster, namespace, "polykvpools", "root", "Ready")
        scrapes.append(scrape())
    for before, after in itertools.pairwise(scrapes):
        for key, value in before.items():
            assert after.get(key, 0.0) >= value, (key, value, after.get(key))
    assert any(k[0] == "polykv_operator_reconcile_total" for k in scrapes[-1])
    assert condition(get(k8s_cluster, namespace, "polykvpools", "root"), "Ready") == "True"


def test_a_tree_larger_than_max_pools_degrades_and_survives_an_engine_restart(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str, operator: Operator
) -> None:
    """Figure: the CRD refuses parallel + maxPools + 1 > 256 with the reason; 6 pools on an
    engine with maxPools 3 are all Ready (3 evicted, said by the engine's `PoolsEvicted`);
    after a SIGKILL of the engine the replica is back in service (gate True) with all 6, and
    a session attaches to an evicted pool by name."""
    too_big = engine_manifest("huge")
    too_big["spec"]["maxPools"] = 254  # parallel 2 + 254 + 1 = 257
    out = k8s_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps(too_big), check=False
    )
    assert out.returncode != 0 and "parallel + maxPools + 1 must be at most 256" in out.stderr
    engine = engine_manifest()
    engine["spec"]["maxPools"] = 3
    systems = [{"role": "system", "content": f"{ROOT} Root {i}."} for i in range(6)]
    roots = [pool_manifest(f"r{i}", messages=[systems[i]]) for i in range(6)]
    apply(k8s_cluster, namespace, engine, *roots)
    names = {f"r{i}" for i in range(6)}
    converged(k8s_cluster, namespace, names)

    def evicted_said() -> Obj | None:
        obj = get(k8s_cluster, namespace, "polykvengines", "eng")
        return obj if reason(obj, "Ready")[0] == "PoolsEvicted" else None

    said = eventually("engine says PoolsEvicted", evicted_said, 60)
    assert said["status"]["replicaStatus"][0]["poolsEvicted"] == 3
    api = EngineApi(k8s_cluster, namespace)
    (rep,) = replicas(k8s_cluster, namespace)
    pid = process_node.pid(namespace, rep.pod)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)

    def back() -> bool | None:
        (now,) = replicas(k8s_cluster, namespace) or [None]
        if now is None or now.restarts == rep.restarts:
            return None
        pod = k8s_cluster.api.get(f"/api/v1/namespaces/{namespace}/pods/{now.pod}")
        held = api.pools_or_none(now.ip) or {}
        return True if condition(pod, "Ready") == "True" and set(held) == names else None

    eventually("replica back in service with every pool", back, 120)
    held = api.pools(rep.ip)
    cold = sorted(n for n, p in held.items() if p.residency == "evicted")
    assert len(cold) == 3, held
    system = systems[int(cold[0][1:])]
    reply = api.chat(rep.ip, cold[0], [system, {"role": "user", "content": "Hi."}], None)
    assert reply["choices"][0]["message"] is not None
