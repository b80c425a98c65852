"""The operator on the real control plane, with real engine processes, under its own RBAC.

Every test gets a namespace enforcing the restricted Pod Security profile, the CRDs from
crds/, and the operator as a child process logged in as the polykv-operator ServiceAccount
(operator/deploy/rbac.yaml), so a missing permission fails the test (no "forbidden" in its
log). Engines run the generated test model, written by their init container.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_api.models import PoolStatus
from polykv_operator.manifests import admin_key
from polykv_operator.names import GATE
from polykv_testenv import ApiError, ControlPlane, ProcessNode
from polykv_testenv.kubeapi import Gone
from polykv_testenv.operator import OperatorProcess
from polykv_testenv.waiting import free_port

from ..helpers import Obj, condition, eventually, get_or_none, kubeconfig_for

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[3]
GROUP_PATH = "/apis/polykv.io/v1alpha1/namespaces/{ns}"
MASTER = "e2e-master-key"

SYSTEM = {"role": "system", "content": "You are the research crew. Cite sources, be brief."}
BRIEF = {"role": "user", "content": "Task briefing: survey shared-prefix KV caching."}
SHELL = {"role": "system", "content": "You are the research crew. Use the shell sandbox."}
# In the order an agent writes it, not sorted: the API server stores a pool's tools with
# sorted keys, and the engine renders tools canonically, so attaching with this order still
# reuses the pool's whole prefix (the test checks both).
TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}

# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def operator_kubeconfig(
    k8s_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """CRDs and RBAC installed; a kubeconfig holding the operator ServiceAccount's token."""
    k8s_cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    for crd in ("polykvengines", "polykvpools", "admissionpolicies"):
        k8s_cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{crd}.polykv.io", "--timeout=60s",
            timeout_s=90,
        )  # fmt: skip
    k8s_cluster.kubectl("create", "namespace", "polykv-system", check=False)
    k8s_cluster.kubectl("apply", "-f", str(ROOT / "operator" / "deploy" / "rbac.yaml"))
    token = k8s_cluster.kubectl(
        "create", "token", "polykv-operator", "-n", "polykv-system", "--duration=3h"
    ).stdout.strip()
    return kubeconfig_for(k8s_cluster, token, tmp_path_factory.mktemp("operator") / "kubeconfig")


class Operator:
    """The operator as a child process (restartable: each run logs to its own file)."""

    def __init__(self, cluster: ControlPlane, namespace: str, kubeconfig: Path, logs: Path) -> None:
        self.cluster, self.namespace, self.kubeconfig, self.logs = (
            cluster,
            namespace,
            kubeconfig,
            logs,
        )
        self.runs: list[OperatorProcess] = []
        self.metrics_port = free_port()
        # (from, to) wall-clock windows in which a "forbidden" answer is the API server's and
        # not our RBAC's: a restarted kube-apiserver answers 403 until its authorizer has
        # synced, and it is not ready (/readyz) until then.
        self.forbidden_ok: list[tuple[datetime, datetime]] = []

    def start(
        self, kubeconfig: Path | None = None, peering: str | None = None, **extra: str
    ) -> Operator:
        env = {
            "KUBECONFIG": str(kubeconfig or self.kubeconfig),
            "POLYKV_OPERATOR_MASTER_KEY": MASTER,
            "POLYKV_OPERATOR_POLL_INTERVAL": "0.5",
            "POLYKV_OPERATOR_METRICS_PORT": str(self.metrics_port),
            **extra,
        }
        log = self.logs / f"operator-{len(self.runs)}.log"
        proc = OperatorProcess(
            self.cluster, "polykv_operator.main", self.namespace, log, env, peering=peering
        )
        proc.start()
        self.runs.append(proc)
        return self

    def kill(self) -> None:
        self.runs[-1].kill()

    def stop(self) -> None:
        self.runs[-1].stop()

    def stop_all(self) -> None:
        """Every run this test started, whatever state it is in (a no-op for dead ones)."""
        for run in self.runs:
            run.stop()

    def alive(self) -> bool:
        return self.runs[-1].proc.alive()

    def log(self) -> str:
        return "".join(r.log() for r in self.runs)


@contextmanager
def operator_running(
    k8s_cluster: ControlPlane,
    namespace: str,
    operator_kubeconfig: Path,
    tmp_path: Path,
    **env: str,
) -> Iterator[Operator]:
    """The operator on `namespace` (restricted Pod Security), with `env` added to its own;
    on the way out every CR of the namespace is deleted while it still runs, and it is
    stopped, pass or fail. A "forbidden" in its log fails the test."""
    k8s_cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    op = Operator(k8s_cluster, namespace, operator_kubeconfig, tmp_path).start(**env)
    try:
        yield op
        unexplained = forbidden_lines(op.log(), op.forbidden_ok)
        assert not unexplained, unexplained
    finally:
        try:
            # Leave nothing behind for the namespace controller to wait on: pools release
            # through their finalizer while the operator still runs.
            if not op.alive():
                op.start(**env)
            k8s_cluster.kubectl(
                "delete",
                "polykvpools,admissionpolicies,polykvengines",
                "--all",
                "-n",
                namespace,
                "--timeout=60s",
                check=False,
                timeout_s=90,  # past kubectl's own timeout, so kubectl reports it, not us
            )
        finally:
            op.stop_all()  # pass, fail or a teardown that timed out: no operator outlives it
            print(f"operator logs: {tmp_path}")


@pytest.fixture
def operator(
    k8s_cluster: ControlPlane,
    process_node: ProcessNode,
    namespace: str,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> Iterator[Operator]:
    with operator_running(k8s_cluster, namespace, operator_kubeconfig, tmp_path) as op:
        yield op


LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")


def forbidden_lines(text: str, windows: Sequence[tuple[datetime, datetime]] = ()) -> str:
    """The operator's log lines that say "forbidden", but for those stamped inside one of
    ``windows`` (a second of slack each side: the log's clock and ours)."""
    slack = timedelta(seconds=1)

    def expected(line: str) -> bool:
        m = LOG_TIME.match(line)
        if m is None:
            return False
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
        return any(lo - slack <= at <= hi + slack for lo, hi in windows)

    lines = [ln for ln in text.splitlines() if re.search("forbidden", ln, re.IGNORECASE)]
    return "\n".join(ln for ln in lines if not expected(ln))[:3000]


# ----------------------------------------------------------------------------- helpers


def engine_manifest(name: str = "eng", replicas: int = 1, preset: str = "test") -> Obj:
    """An engine on a generated model (``preset``: polykv-make-model's)."""
    path = f"/models/polykv-{preset}.gguf"
    return {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "PolyKVEngine",
        "metadata": {"name": name},
        "spec": {
            "model": {
                "path": path,
                "init": {"command": ["polykv-make-model", "--preset", preset, path]},
            },
            "replicas": replicas,
            "parallel": 2,
            "contextSize": 2048,
            "maxPools": 8,
            "threads": 1,
        },
    }


def pool_manifest(
    name: str, engine: str = "eng", labels: dict[str, str] | None = None, **spec: Any
) -> Obj:
    return {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "PolyKVPool",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"engineRef": {"name": engine}, **spec},
    }


def tree_manifests() -> list[Obj]:
    return [
        pool_manifest("crew", messages=[SYSTEM], tools=[TOOL], labels={"tier": "interactive"}),
        pool_manifest(
            "planner", parent="crew", appendMessages=[BRIEF], labels={"tier": "interactive"}
        ),
        pool_manifest("shell", parent="crew", messages=[SHELL]),
    ]


def apply(cluster: ControlPlane, namespace: str, *objs: Obj) -> None:
    cluster.apply("\n---\n".join(json.dumps(o) for o in objs), namespace)


def obj_path(namespace: str, plural: str, name: str = "") -> str:
    base = f"{GROUP_PATH.format(ns=namespace)}/{plural}"
    return f"{base}/{name}" if name else base


def get(cluster: ControlPlane, namespace: str, plural: str, name: str) -> Obj:
    return cluster.api.get(obj_path(namespace, plural, name))


def wait_condition(
    cluster: ControlPlane, namespace: str, plural: str, name: str, ctype: str, timeout_s: float = 90
) -> Obj:
    def probe() -> Obj | None:
        obj = get_or_none(cluster.api, obj_path(namespace, plural, name))
        return obj if obj is not None and condition(obj, ctype) == "True" else None

    return eventually(f"{plural}/{name} {ctype}", probe, timeout_s)


def reason(obj: Obj, ctype: str) -> tuple[str, str]:
    for c in obj.get("status", {}).get("conditions") or []:
        if c["type"] == ctype:
            return c["reason"], c["message"]
    return "", ""


@dataclass
class Replica:
    pod: str
    uid: str
    ip: str
    restarts: int


def replicas(cluster: ControlPlane, namespace: str, engine: str = "eng") -> list[Replica]:
    pods = cluster.api.get(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"polykv.io/engine={engine}"
    )
    out = []
    for p in pods["items"]:
        if p["metadata"].get("deletionTimestamp") or not p["status"].get("podIP"):
            continue
        restarts = sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or [])
        out.append(
            Replica(p["metadata"]["name"], p["metadata"]["uid"], p["status"]["podIP"], restarts)
        )
    return sorted(out, key=lambda r: r.pod)


class EngineApi:
    """Direct access to the engine replicas, with the key the operator derives."""

    def __init__(self, cluster: ControlPlane, namespace: str, engine: str = "eng") -> None:
        uid = get(cluster, namespace, "polykvengines", engine)["metadata"]["uid"]
        self.headers = {"Authorization": f"Bearer {admin_key(MASTER, namespace, engine, uid)}"}

    def pools(self, ip: str) -> dict[str, PoolStatus]:
        r = httpx.get(f"http://{ip}:8080/polykv/pools", headers=self.headers, timeout=10)
        r.raise_for_status()
        return {p["name"]: PoolStatus.model_validate(p) for p in r.json()["pools"]}

    def create(self, ip: str, body: Obj) -> str:
        """A root pool made by hand on one replica; its prefix hash."""
        url = f"http://{ip}:8080/polykv/pools"
        r = httpx.post(url, json=body, headers=self.headers, timeout=60)
        r.raise_for_status()
        return str(r.json()["prefix_hash"])

    def pools_or_none(self, ip: str) -> dict[str, PoolStatus] | None:
        try:
            return self.pools(ip)
        except httpx.HTTPError:
            return None

    def chat(self, ip: str, pool: str, messages: list[Obj], tools: list[Obj] | None) -> Obj:
        body: Obj = {"pool_id": pool, "messages": messages, "max_tokens": 4, "temperature": 0}
        if tools:
            body["tools"] = tools
        headers = {**self.headers, "x-session-id": f"agent-{pool}-{ip}"}
        r = httpx.post(
            f"http://{ip}:8080/v1/chat/completions", json=body, headers=headers, timeout=60
        )
        r.raise_for_status()
        result: Obj = r.json()
        return result


class PodWatch:
    """Records every pod event of the namespace with the time it arrived."""

    def __init__(self, cluster: ControlPlane, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.events: list[tuple[float, Obj]] = []
        self._stop = threading.Event()
        path = f"/api/v1/namespaces/{namespace}/pods"
        self._rv = cluster.api.get(path)["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, args=(path,), daemon=True)
        self._thread.start()

    def _run(self, path: str) -> None:
        while not self._stop.is_set():
            try:
                for ev in self.cluster.api.watch(path, self._rv, timeout_s=5):
                    obj = ev["object"]
                    self._rv = obj["metadata"].get("resourceVersion", self._rv)
                    if ev["type"] != "BOOKMARK":
                        self.events.append((time.time(), obj))
            except (Gone, ApiError, httpx.HTTPError):
                time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()

    def first(self, pred: Any, after: float = 0.0) -> float | None:
        for t, obj in list(self.events):
            if t >= after and pred(obj):
                return t
        return None


def no_pools(cluster: ControlPlane, namespace: str) -> bool | None:
    return True if not cluster.api.get(obj_path(namespace, "polykvpools"))["items"] else None


def gate_of(obj: Obj) -> str | None:
    return condition(obj, GATE)


def is_pod(uid: str) -> Any:
    return lambda obj: obj["metadata"]["uid"] == uid


# ------------------------------------------------------------------------------- tests


def test_tree_on_every_replica_scale_and_attach_by_name(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    apply(k8s_cluster, namespace, engine_manifest(), *tree_manifests())
    for name in ("crew", "planner", "shell"):
        wait_condition(k8s_cluster, namespace, "polykvpools", name, "Ready")
    crew, planner, shell = (
        get(k8s_cluster, namespace, "polykvpools", n)["status"]
        for n in ("crew", "planner", "shell")
    )
    # extend: the parent's whole prefix; branch: diverges inside it. Nobody counted tokens.
    assert crew["branchPos"] == 0 and crew["depth"] == 0 and crew["path"] == "crew"
    assert planner["branchPos"] == crew["prefixLen"] < planner["prefixLen"]
    assert 0 < shell["branchPos"] < crew["prefixLen"] and shell["path"] == "crew/shell"
    eng = EngineApi(k8s_cluster, namespace)

    # Scale through the scale subresource (what an HPA uses); watch the new pod.
    watch = PodWatch(k8s_cluster, namespace)
    before = {r.uid for r in replicas(k8s_cluster, namespace)}
    k8s_cluster.kubectl("scale", "polykvengine/eng", "--replicas=2", "-n", namespace)
    both = eventually(
        "2 replicas", lambda: r if len(r := replicas(k8s_cluster, namespace)) == 2 else None, 60
    )
    new = next(r for r in both if r.uid not in before)
    ready_at = eventually(
        "new replica Ready",
        lambda: watch.first(lambda o: is_pod(new.uid)(o) and condition(o, "Ready") == "True"),
        90,
    )
    watch.stop()
    on_new = eng.pools(new.ip)
    assert set(on_new) >= {"crew", "planner", "shell"}
    # Every pool was on the new replica before the pod turned Ready.
    assert max(on_new[n].created_ts for n in ("crew", "planner", "shell")) < ready_at
    wait_condition(k8s_cluster, namespace, "polykvengines", "eng", "Ready")

    def on_both() -> dict[str, Obj] | None:
        out = {
            n: get(k8s_cluster, namespace, "polykvpools", n)["status"]
            for n in ("crew", "planner", "shell")
        }
        listed = all(len(st.get("replicas") or []) == 2 and "capacity" in st for st in out.values())
        return out if listed else None

    statuses = eventually("pool status lists both replicas and capacity", on_both, 30)
    for st in statuses.values():
        # From the listing: idle pools admit, with a slot free on each replica.
        assert st["capacity"]["canAdmit"] and st["capacity"]["reason"] == "ok", st
        assert st["capacity"]["headroomSessions"] >= 2 and not st["capacity"]["settling"], st
        assert 0.0 <= st["compactionPressure"] <= 1.0, st
    stored = get(k8s_cluster, namespace, "polykvpools", "crew")["spec"]["tools"]
    assert stored == [TOOL] and json.dumps(stored) != json.dumps([TOOL])  # other key order
    for r in both:
        listed = eng.pools(r.ip)
        for name, st in statuses.items():
            p = listed[name]
            assert (p.prefix_len, p.branch_pos, p.prefix_hash) == (
                st["prefixLen"],
                st["branchPos"],
                st["prefixHash"],
            )
            assert {x["pod"]: x["poolId"] for x in st["replicas"]}[r.pod] == p.pool_id
        assert listed["planner"].parent_name == "crew" and listed["shell"].parent_name == "crew"
        # A session attaching by pool name reuses the whole prefix on every replica, its tools
        # in its own key order.
        go = {"role": "user", "content": "Go."}
        attaches = {
            "crew": ([SYSTEM, go], [TOOL]),
            "planner": ([SYSTEM, BRIEF, go], [TOOL]),
            "shell": ([SHELL, go], None),
        }
        for name, (messages, tools) in attaches.items():
            timings = eng.chat(r.ip, name, messages, tools)["timings"]
            assert timings["cache_n"] >= statuses[name]["prefixLen"], (r.pod, name, timings)

    table = k8s_cluster.kubectl("get", "polykvpools", "-n", namespace).stdout
    assert re.search(r"planner\s+crew/planner\s+\d+\s+\d+", table), table
    engine = get(k8s_cluster, namespace, "polykvengines", "eng")["status"]
    assert engine["readyReplicas"] == 2 and engine["selector"] == "polykv.io/engine=eng"
    assert len({r["bootId"] for r in engine["replicaStatus"]}) == 2
    scraped = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=10).text
    labels = f'engine="eng",namespace="{namespace}"'
    assert f"polykv_engine_replicas_pools_ready{{{labels}}} 2.0" in scraped
    assert f"polykv_engine_pools{{{labels}}} 3.0" in scraped
    assert 'polykv_operator_reconcile_total{handler="round",kind="engine",result="ok"}' in scraped
    assert "polykv_operator_engine_poll_seconds_count" in scraped
    assert 'op="list"' in scraped and 'op="capacity"' not in scraped  # one listing, no more


def test_engine_restart_rematerializes_the_tree_before_the_gate(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str, operator: Operator
) -> None:
    policy = {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "AdmissionPolicy",
        "metadata": {"name": "floor"},
        "spec": {
            "poolSelector": {"matchLabels": {"tier": "interactive"}},
            "targetTpsPerSession": 3,
        },
    }
    apply(k8s_cluster, namespace, engine_manifest(), *tree_manifests(), policy)
    wait_condition(k8s_cluster, namespace, "admissionpolicies", "floor", "Ready")
    for name in ("crew", "planner", "shell"):
        wait_condition(k8s_cluster, namespace, "polykvpools", name, "Ready")
    eng = EngineApi(k8s_cluster, namespace)
    (rep,) = replicas(k8s_cluster, namespace)
    old_boot = get(k8s_cluster, namespace, "polykvengines", "eng")["status"]["replicaStatus"][0][
        "bootId"
    ]
    watch = PodWatch(k8s_cluster, namespace)
    pid = process_node.pid(namespace, rep.pod)
    assert pid is not None
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)

    def back() -> float | None:
        down = watch.first(lambda o: is_pod(rep.uid)(o) and gate_of(o) == "False", killed_at)
        if down is None:
            return None
        return watch.first(lambda o: is_pod(rep.uid)(o) and condition(o, "Ready") == "True", down)

    ready_again = eventually("gate False, then Ready again", back, 90)
    watch.stop()
    pools = eng.pools(rep.ip)
    assert set(pools) >= {"crew", "planner", "shell"}
    assert max(p.created_ts for p in pools.values()) < ready_again
    assert all(p.created_ts > killed_at for p in pools.values())  # a new engine, rebuilt
    # ...with its admission policies pushed again.
    assert pools["crew"].admission is not None and pools["planner"].admission is not None
    assert pools["shell"].admission is None

    def new_boot() -> str | None:
        rows = get(k8s_cluster, namespace, "polykvengines", "eng")["status"]["replicaStatus"]
        return rows[0]["bootId"] if rows[0].get("bootId") not in (None, old_boot) else None

    boot = eventually("engine status shows the new boot id", new_boot, 30)

    def pool_on_new_boot() -> Obj | None:
        obj = get(k8s_cluster, namespace, "polykvpools", "planner")
        rows = obj["status"].get("replicas") or []
        return (
            obj
            if condition(obj, "Ready") == "True" and rows and rows[0]["bootId"] == boot
            else None
        )

    eventually("pool status on the new boot", pool_on_new_boot, 30)


def test_delete_root_removes_the_tree_leaves_first(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    apply(
        k8s_cluster,
        namespace,
        engine_manifest(),
        *tree_manifests(),
        pool_manifest(
            "deep", parent="planner", appendMessages=[{"role": "user", "content": "More."}]
        ),
    )
    wait_condition(k8s_cluster, namespace, "polykvpools", "deep", "Ready")
    eng = EngineApi(k8s_cluster, namespace)
    (rep,) = replicas(k8s_cluster, namespace)
    # Background propagation: our finalizer, not the garbage collector, orders the deletion.
    k8s_cluster.kubectl("delete", "polykvpool/crew", "-n", namespace, "--wait=false")
    eventually(
        "every pool gone from the API",
        lambda: (
            True if not k8s_cluster.api.get(obj_path(namespace, "polykvpools"))["items"] else None
        ),
        60,
    )
    assert eng.pools(rep.ip) == {}
    order = re.findall(r"pool release ns=\S+ engine=eng pool=(\S+) released=\['", operator.log())
    assert order.index("deep") < order.index("planner") < order.index("crew")
    assert order.index("shell") < order.index("crew")


def chain_manifests(n: int) -> list[Obj]:
    out = [pool_manifest("p0", messages=[SYSTEM])]
    for i in range(1, n):
        turn = {"role": "user", "content": f"Step {i}: " + "expand the survey. " * 10}
        out.append(pool_manifest(f"p{i}", parent=f"p{i - 1}", appendMessages=[turn]))
    return out


def test_operator_killed_mid_create_leaves_no_duplicate_and_no_lost_pool(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    apply(k8s_cluster, namespace, engine_manifest())
    wait_condition(k8s_cluster, namespace, "polykvengines", "eng", "Ready")
    eng = EngineApi(k8s_cluster, namespace)
    (rep,) = replicas(k8s_cluster, namespace)
    # SIGKILL right after the 3rd pool is created on the engine, before any status says so.
    operator.stop()
    operator.start(POLYKV_OPERATOR_CRASH_AT="pool-created:3")
    apply(k8s_cluster, namespace, *chain_manifests(6))
    eventually("operator crashed", lambda: True if not operator.runs[-1].proc.alive() else None, 60)
    partial = eng.pools(rep.ip)
    assert sorted(partial) == ["p0", "p1", "p2"]
    operator.start()
    for i in range(6):
        wait_condition(k8s_cluster, namespace, "polykvpools", f"p{i}", "Ready")
    final = eng.pools(rep.ip)
    assert sorted(final) == [f"p{i}" for i in range(6)]  # names are unique: no duplicate
    for name, before in partial.items():
        assert final[name].pool_id == before.pool_id  # adopted, not re-created
    for i in range(6):
        st = get(k8s_cluster, namespace, "polykvpools", f"p{i}")["status"]
        ((pod, pool_id),) = [(x["pod"], x["poolId"]) for x in st["replicas"]]
        assert (pod, pool_id) == (rep.pod, final[f"p{i}"].pool_id)
        assert st["depth"] == i and st["path"] == "/".join(f"p{j}" for j in range(i + 1))


def test_operator_killed_mid_delete_leaks_nothing(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    # SIGKILL right after the 2nd release on the engine, before its finalizer is removed.
    operator.stop()
    operator.start(POLYKV_OPERATOR_CRASH_AT="pool-released:2")
    apply(k8s_cluster, namespace, engine_manifest(), *chain_manifests(4))
    wait_condition(k8s_cluster, namespace, "polykvpools", "p3", "Ready")
    eng = EngineApi(k8s_cluster, namespace)
    (rep,) = replicas(k8s_cluster, namespace)
    k8s_cluster.kubectl("delete", "polykvpool/p0", "-n", namespace, "--wait=false")
    eventually("operator crashed", lambda: True if not operator.runs[-1].proc.alive() else None, 60)
    assert sorted(eng.pools(rep.ip)) == ["p0", "p1"]  # leaves first: p3, then p2
    operator.start()
    eventually("every pool gone from the API", lambda: no_pools(k8s_cluster, namespace), 60)
    assert eng.pools(rep.ip) == {}


def test_invalid_specs_stall_with_a_precise_reason(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    apply(
        k8s_cluster, namespace, engine_manifest(), pool_manifest("root", text="You are the crew.\n")
    )
    root = wait_condition(k8s_cluster, namespace, "polykvpools", "root", "Ready")
    length = root["status"]["prefixLen"]
    # A pool someone made on the engine by hand, under the name of a PolyKVPool to come: the
    # engine refuses it with the reason code name_conflict, whatever its wording.
    eng = EngineApi(k8s_cluster, namespace)
    (rep,) = replicas(k8s_cluster, namespace)
    theirs = eng.create(rep.ip, {"name": "squatter", "prompt": "Somebody else's prefix."})
    apply(
        k8s_cluster,
        namespace,
        pool_manifest("squatter", text="Our own prefix."),
        pool_manifest(
            "too-far", parent="root", text="You are the crew.\nAnd more.", branchPos=length + 5
        ),
        pool_manifest("orphan", parent="agent-rot", appendText=" hi"),
        pool_manifest("lost", engine="no-such-engine", text="hello"),
        pool_manifest("mixed", parent="root", appendMessages=[BRIEF]),
    )
    expect = {
        "too-far": (
            "BranchPosOutOfRange",
            f'branchPos {length + 5} is beyond the end of parent "root" ({length} tokens)',
        ),
        "orphan": ("ParentNotFound", f'pool "agent-rot" does not exist in namespace {namespace}'),
        "lost": (
            "EngineNotFound",
            f'engine "no-such-engine" does not exist in namespace {namespace}',
        ),
        "mixed": ("AppendMismatch", 'parent "root" is given as text'),
        "squatter": ("NameConflict", "DELETE /polykv/pools/squatter"),
    }
    for name, (want_reason, want_text) in expect.items():
        obj = wait_condition(k8s_cluster, namespace, "polykvpools", name, "Stalled", 60)
        got_reason, got_message = reason(obj, "Stalled")
        assert got_reason == want_reason and want_text in got_message, (name, got_message)
        assert condition(obj, "Ready") == "False"
    # Nothing half-created: only the valid root is on the engine (and the squatter, as made).
    on_engine = eng.pools(rep.ip)
    assert set(on_engine) == {"root", "squatter"}
    assert on_engine["squatter"].prefix_hash == theirs
    # The spec is immutable: the API server refuses an edit.
    out = k8s_cluster.kubectl(
        "patch",
        "polykvpool/root",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"text":"Other."}}',
        check=False,
    )
    assert out.returncode != 0 and "immutable" in out.stderr
    # A parent applied later un-stalls its child (and links it for garbage collection).
    apply(k8s_cluster, namespace, pool_manifest("agent-rot", text="Fixed."))
    wait_condition(k8s_cluster, namespace, "polykvpools", "orphan", "Ready")

    def linked() -> list[Obj] | None:
        refs = get(k8s_cluster, namespace, "polykvpools", "orphan")["metadata"]
        return refs.get("ownerReferences") or None

    assert eventually("ownerReference to the new parent", linked, 30)[0]["name"] == "agent-rot"


def test_a_branch_below_its_parent_on_a_recurrent_model_stalls_with_the_reason(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    # A Mamba engine: its state exists only at the end of a prefix, so a child pool must
    # extend its parent. A child that leaves the parent's text inside it (the operator
    # computes a branchPos below the parent's length) is refused by the engine with the
    # code recurrent_branch, which the pool shows as its Stalled reason, with the fix.
    root_text = "You are the crew. Cite sources and be brief in every answer.\n"
    apply(
        k8s_cluster,
        namespace,
        engine_manifest("rec", preset="test-mamba"),
        pool_manifest("rec-root", engine="rec", text=root_text),
        pool_manifest("rec-ext", engine="rec", parent="rec-root", text=root_text + "Tools: web."),
        pool_manifest("rec-branch", engine="rec", parent="rec-root", text="You are the shell."),
    )
    wait_condition(k8s_cluster, namespace, "polykvpools", "rec-ext", "Ready")
    obj = wait_condition(k8s_cluster, namespace, "polykvpools", "rec-branch", "Stalled", 60)
    got_reason, message = reason(obj, "Stalled")
    assert got_reason == "RecurrentBranch", message
    assert "start its prefix with the parent's whole prefix" in message
    assert condition(obj, "Ready") == "False"
    eng = EngineApi(k8s_cluster, namespace, "rec")
    (rep,) = replicas(k8s_cluster, namespace, "rec")
    assert set(eng.pools(rep.ip)) == {"rec-root", "rec-ext"}  # nothing half-made


def test_two_policies_on_one_pool_is_a_condition(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    def policy(name: str, **spec: Any) -> Obj:
        return {
            "apiVersion": "polykv.io/v1alpha1",
            "kind": "AdmissionPolicy",
            "metadata": {"name": name},
            "spec": {"targetTpsPerSession": 4, **spec},
        }

    apply(
        k8s_cluster,
        namespace,
        engine_manifest(),
        *tree_manifests(),
        policy("floor", poolSelector={"matchLabels": {"tier": "interactive"}}, mode="enforced"),
    )
    wait_condition(k8s_cluster, namespace, "admissionpolicies", "floor", "Ready")
    eng = EngineApi(k8s_cluster, namespace)
    ip = replicas(k8s_cluster, namespace)[0].ip
    pools = eng.pools(ip)
    assert pools["planner"].admission is not None and pools["planner"].admission.mode == "enforced"
    assert (
        get(k8s_cluster, namespace, "polykvpools", "planner")["status"]["admissionPolicy"]
        == "floor"
    )
    apply(
        k8s_cluster,
        namespace,
        policy("strict", poolRefs=[{"name": "planner"}], targetTpsPerSession=9),
    )
    obj = wait_condition(k8s_cluster, namespace, "admissionpolicies", "strict", "Stalled", 30)
    got, message = reason(obj, "Stalled")
    assert got == "PoolSelectedTwice" and "floor" in message
    assert (
        reason(
            wait_condition(k8s_cluster, namespace, "admissionpolicies", "floor", "Stalled", 30),
            "Stalled",
        )[0]
        == "PoolSelectedTwice"
    )
    assert obj["status"]["conflicts"] == [{"pool": "planner", "policies": ["floor", "strict"]}]
    assert eng.pools(ip)["planner"].admission.target_tps_per_session == 4  # no silent winner
    # Deleting a policy takes it off the engines.
    k8s_cluster.kubectl(
        "delete", "admissionpolicy/strict", "admissionpolicy/floor", "-n", namespace
    )
    eventually(
        "policies cleared",
        lambda: True if all(p.admission is None for p in eng.pools(ip).values()) else None,
        30,
    )


def test_unreachable_replica_keeps_the_finalizer(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str, operator: Operator
) -> None:
    apply(
        k8s_cluster, namespace, engine_manifest(), pool_manifest("root", text="You are the crew.\n")
    )
    wait_condition(k8s_cluster, namespace, "polykvpools", "root", "Ready")
    (rep,) = replicas(k8s_cluster, namespace)
    pid = process_node.pid(namespace, rep.pod)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # a partition: the process lives, nothing answers
    try:
        k8s_cluster.kubectl("delete", "polykvpool/root", "-n", namespace, "--wait=false")

        def held() -> Obj | None:
            obj = get(k8s_cluster, namespace, "polykvpools", "root")
            return obj if reason(obj, "Ready")[0] == "EngineUnreachable" else None

        obj = eventually("condition says the replica is unreachable", held, 60)
        assert obj["metadata"]["finalizers"] == ["polykv.io/finalizer"]
        assert condition(obj, "Ready") == "Unknown"
        assert rep.pod in reason(obj, "Ready")[1]
    finally:
        os.kill(pid, signal.SIGCONT)
    eventually(
        "released once the replica answers",
        lambda: (
            True
            if get_or_none(k8s_cluster.api, obj_path(namespace, "polykvpools", "root")) is None
            else None
        ),
        60,
    )
    eng = EngineApi(k8s_cluster, namespace)
    assert eng.pools(rep.ip) == {}
