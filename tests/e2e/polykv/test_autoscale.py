"""Autoscaling a PolyKVEngine with the real HPA controller of kube-controller-manager (sync
period 5 s) through the operator's own external.metrics.k8s.io API.

The operator runs as in test_operator.py (its ServiceAccount, rbac.yaml, plus the provider's
external-metrics-rbac.yaml) with the external metrics API on 127.0.0.1: an ExternalName
Service points the APIService at it, and the aggregator proxies to it over TLS with the
front-proxy client certificate. The APIService is removed before the operator stops (a
registered API without a backend holds up namespace deletion for the whole cluster).

Engines run the generated test model; load is real turns on real engine processes.
"""

from __future__ import annotations

import base64
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from polykv_operator.autoscale.apiservice import desired
from polykv_operator.manifests import API_SECRET_KEY, api_key_secret_name
from polykv_testenv import ApiError, ControlPlane, ProcessNode, pki
from polykv_testenv.waiting import free_port

from ..helpers import Obj, condition, eventually, get_or_none
from .test_operator import (
    ROOT,
    EngineApi,
    Operator,
    PodWatch,
    apply,
    engine_manifest,
    get,
    is_pod,
    operator_running,
    pool_manifest,
    replicas,
)
from .test_rbac import As, token_of

pytestmark = pytest.mark.k8s

APISERVICE = "/apis/apiregistration.k8s.io/v1/apiservices/v1beta1.external.metrics.k8s.io"
CREW = "You are the research crew. Answer every task at length."
SERVICE = "polykv-metrics"
API = "polykv.io/v1alpha1"


@dataclass
class Provider:
    op: Operator
    namespace: str
    json_port: int
    tls_port: int


@pytest.fixture
def provider(
    k8s_cluster: ControlPlane,
    process_node: ProcessNode,
    namespace: str,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> Iterator[Provider]:
    k8s_cluster.kubectl(
        "apply", "-f", str(ROOT / "operator" / "deploy" / "external-metrics-rbac.yaml")
    )
    ca = pki.authority(tmp_path, "metrics")
    cert, key = pki.leaf(ca, tmp_path, "metrics", SERVICE, (f"{SERVICE}.{namespace}.svc",))
    json_port, tls_port = free_port(), free_port()
    env = {
        "POLYKV_OPERATOR_METRICS_ADDRESS": "127.0.0.1",
        "POLYKV_OPERATOR_AUTOSCALE_PORT": str(json_port),
        "POLYKV_OPERATOR_EXTERNAL_METRICS_PORT": str(tls_port),
        "POLYKV_OPERATOR_EXTERNAL_METRICS_CERT": str(cert),
        "POLYKV_OPERATOR_EXTERNAL_METRICS_KEY": str(key),
        "POLYKV_OPERATOR_EXTERNAL_METRICS_SERVICE": f"{namespace}/{SERVICE}",
        "POLYKV_OPERATOR_EXTERNAL_METRICS_CA": str(ca.cert),
    }
    with operator_running(k8s_cluster, namespace, operator_kubeconfig, tmp_path, **env) as op:
        # Endpoints cannot hold loopback addresses; the aggregator resolves an ExternalName
        # Service to https://<externalName>:<the APIService's port>.
        svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE}}
        svc["spec"] = {"type": "ExternalName", "externalName": "127.0.0.1"}
        k8s_cluster.apply(svc, namespace)
        # As the chart renders it: no caBundle. The operator sets it from its CA.
        k8s_cluster.apply(desired(namespace, SERVICE, tls_port))
        try:
            yield Provider(op, namespace, json_port, tls_port)
        finally:
            k8s_cluster.kubectl("delete", "hpa", "--all", "-n", namespace, check=False)
            k8s_cluster.kubectl(
                "delete", "apiservice", "v1beta1.external.metrics.k8s.io", "--wait=true",
                check=False, timeout_s=90,
            )  # fmt: skip


# ----------------------------------------------------------------------------- helpers


def raw(cluster: ControlPlane, metric: str, namespace: str, selector: str) -> Any:
    """`kubectl get --raw` of one external metric, parsed; a failure raises with its text."""
    path = (
        f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/{metric}"
        f"?labelSelector={quote(selector, safe='')}"
    )
    out = cluster.kubectl("get", "--raw", path, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    return json.loads(out.stdout)


def value_of(cluster: ControlPlane, metric: str, namespace: str, engine: str = "eng") -> float:
    doc = raw(cluster, metric, namespace, f"polykv.io/engine={engine}")
    (item,) = doc["items"]
    return quantity(item["value"])


def quantity(text: str) -> float:
    """A Kubernetes quantity as the metrics APIs write it ("850m", "2")."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def value_or_none(cluster: ControlPlane, metric: str, namespace: str) -> float | None:
    try:
        return value_of(cluster, metric, namespace)
    except RuntimeError:
        return None


def available(cluster: ControlPlane) -> Obj | None:
    obj = get_or_none(cluster.api, APISERVICE)
    return obj if obj is not None and condition(obj, "Available") == "True" else None


def autoscaled_engine(parallel: int) -> Obj:
    engine = engine_manifest(replicas=1)
    engine["spec"]["parallel"] = parallel
    return engine


def policy_manifest(target: Any, mode: str = "advisory") -> Obj:
    return {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "AdmissionPolicy",
        "metadata": {"name": "floor"},
        "spec": {"poolRefs": [{"name": "crew"}], "targetTpsPerSession": target, "mode": mode},
    }


def hpa_manifest(max_replicas: int = 2, down_window_s: int = 15) -> Obj:
    """Both metrics with the targets the chart uses; a short scale-down window for the test
    (the chart's default is minutes)."""
    selector = {"matchLabels": {"polykv.io/engine": "eng"}}

    def metric(name: str, target: str) -> Obj:
        return {
            "type": "External",
            "external": {
                "metric": {"name": name, "selector": selector},
                "target": {"type": "Value", "value": target},
            },
        }

    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "eng"},
        "spec": {
            "scaleTargetRef": {"apiVersion": API, "kind": "PolyKVEngine", "name": "eng"},
            "minReplicas": 1,
            "maxReplicas": max_replicas,
            "metrics": [
                metric("polykv_floor_pressure", "800m"),
                metric("polykv_session_demand_ratio", "850m"),
            ],
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": down_window_s,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}],
                },
            },
        },
    }  # fmt: skip


def spec_replicas(cluster: ControlPlane, namespace: str) -> int:
    return int(get(cluster, namespace, "polykvengines", "eng")["spec"]["replicas"])


def hpa_says(cluster: ControlPlane, namespace: str) -> str:
    path = f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/eng"
    hpa = get_or_none(cluster.api, path)
    if hpa is None:
        return "no HPA"
    st = hpa.get("status") or {}
    conds = "; ".join(
        f"{c['type']}={c['status']} {c.get('message', '')}" for c in st.get("conditions") or []
    )
    return f"current={st.get('currentReplicas')} desired={st.get('desiredReplicas')} {conds}"


def hpa_metric(cluster: ControlPlane, namespace: str, metric: str) -> float | None:
    """The value of an external metric as the HPA last read it (its status), or None."""
    path = f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/eng"
    for m in ((get_or_none(cluster.api, path) or {}).get("status") or {}).get(
        "currentMetrics"
    ) or []:
        ext = m.get("external") or {}
        if (ext.get("metric") or {}).get("name") == metric:
            return quantity(str(ext["current"]["value"]))
    return None


def until(cluster: ControlPlane, namespace: str, what: str, probe: Any, timeout_s: float) -> Any:
    """`eventually`, with the HPA's own account when it does not happen."""
    try:
        return eventually(what, probe, timeout_s)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nHPA: {hpa_says(cluster, namespace)}") from exc


def ready(cluster: ControlPlane, namespace: str) -> bool | None:
    return (
        True
        if condition(get(cluster, namespace, "polykvengines", "eng"), "Ready") == "True"
        else None
    )


@dataclass
class Turn:
    start: float
    end: float
    outcome: str  # done | stopped | cut | refused <status> | unreachable
    tokens: int = 0


@dataclass
class Turns:
    """Back-to-back streamed turns of one session on one replica, in a thread, until
    stopped (a turn in flight is abandoned: "stopped") or until the replica refuses or is
    gone."""

    ip: str
    session: str
    pool: str | None
    key: str  # the engine's inference key (the operator generates one per engine)
    n_predict: int = 160
    read_pause_s: float = 0.0  # a slow reader: each turn's stream stays open for longer
    turns: list[Turn] = field(default_factory=list)
    reading: int = 0  # tokens read so far of the turn in flight
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Turns:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def finished(self) -> bool | None:
        return True if self._thread is not None and not self._thread.is_alive() else None

    def _run(self) -> None:
        while not self._stop.is_set():
            turn = self.one()
            self.turns.append(turn)
            if turn.outcome != "done":
                return

    def one(self) -> Turn:
        prompt = (CREW if self.pool else "Free text.") + f" Task {len(self.turns)}:"
        body: Obj = {"prompt": prompt, "n_predict": self.n_predict, "ignore_eos": True,
                     "temperature": 0, "stream": True}  # fmt: skip
        if self.pool:
            body["pool_id"] = self.pool
        headers = {"x-session-id": self.session, "Authorization": f"Bearer {self.key}"}
        t0, n, final, answered = time.time(), 0, None, False
        try:
            with httpx.stream("POST", f"http://{self.ip}:8080/completion", json=body,
                              headers=headers, timeout=60) as r:  # fmt: skip
                answered = True
                if r.status_code != 200:
                    return Turn(t0, time.time(), f"refused {r.status_code}")
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return Turn(t0, time.time(), "stopped", n)
                    if not line.startswith("data: "):
                        continue
                    if self.read_pause_s:
                        time.sleep(self.read_pause_s)
                    ev = json.loads(line[6:])
                    if ev.get("stop"):
                        final = ev
                    else:
                        n += 1
                        self.reading = n
        except httpx.ConnectError:
            return Turn(t0, time.time(), "unreachable")
        except httpx.HTTPError:
            # Closed before any response (a server on its way out, after its last in-flight
            # answer): not served, as unreachable; closed mid-stream: cut.
            return Turn(t0, time.time(), "cut" if answered else "unreachable", n)
        done = final is not None and final.get("tokens_predicted") == self.n_predict
        return Turn(t0, time.time(), "done" if done else "cut", n)


@dataclass
class DrainWatch:
    """When an engine began draining, as the engine itself says it (its /health turns 503 or
    it stops answering), polled every 20 ms: the pod watch sees the deletion a moment later
    than it happens, and the engine's SIGTERM comes after that by another."""

    ip: str
    began: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> DrainWatch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while not self._stop.wait(0.02):
                try:
                    ok = client.get(f"http://{self.ip}:8080/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                if not ok:
                    self.began = time.time()
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def inference_key(cluster: ControlPlane, namespace: str, engine: str = "eng") -> str:
    """The inference key the operator generated for ``engine`` (agents' key, not the admin's)."""
    name = api_key_secret_name(engine)
    secret = eventually(
        "the engine's API key Secret",
        lambda: get_or_none(cluster.api, f"/api/v1/namespaces/{namespace}/secrets/{name}"),
        60,
    )
    return base64.b64decode(secret["data"][API_SECRET_KEY]).decode()


def measured_tps(eng: EngineApi, ip: str) -> float:
    """The pool's mean experienced tps on one replica, as its engine reports it (median of
    a few polls while the load decodes)."""
    seen: list[float] = []

    def sample() -> bool | None:
        pool = eng.pools(ip)["crew"]
        if pool.n_active > 0:
            seen.append(pool.mean_active_tps)
        time.sleep(0.5)
        return True if len(seen) >= 5 else None

    eventually("5 measured samples", sample, 90)
    return statistics.median(seen)


def pod_costs(cluster: ControlPlane, namespace: str) -> dict[str, str]:
    pods = cluster.api.get(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector="polykv.io/engine=eng"
    )
    return {
        p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(
            "controller.kubernetes.io/pod-deletion-cost", ""
        )
        for p in pods["items"]
        if not p["metadata"].get("deletionTimestamp")
    }


# ------------------------------------------------------------------------------- tests


def test_the_external_metrics_api_serves_one_item_per_engine(
    k8s_cluster: ControlPlane, provider: Provider
) -> None:
    ns = provider.namespace
    apply(k8s_cluster, ns, autoscaled_engine(2), pool_manifest("crew", text=CREW),
          policy_manifest(2.5))  # fmt: skip
    eventually("APIService Available", lambda: available(k8s_cluster), 90)
    eventually(
        "idle engine's floor pressure",
        lambda: v if (v := value_or_none(k8s_cluster, "polykv_floor_pressure", ns)) == 0 else None,
        120,
    )
    doc = raw(k8s_cluster, "polykv_session_demand_ratio", ns, "polykv.io/engine=eng")
    assert doc["kind"] == "ExternalMetricValueList" and len(doc["items"]) == 1, doc
    assert doc["items"][0]["metricLabels"] == {"polykv.io/engine": "eng"}
    assert doc["items"][0]["value"] == "0"
    # Rejections, through the aggregator: the API server hands our Status back.
    for metric, selector, text in [
        ("polykv_floor_pressure", "app=eng", "select one engine"),
        ("polykv_floor_pressure", "polykv.io/engine=nope", "has not polled"),
        ("cpu", "polykv.io/engine=eng", "no external metric"),
    ]:
        with pytest.raises(RuntimeError, match=text):
            raw(k8s_cluster, metric, ns, selector)
    # KEDA's JSON and the Prometheus gauges carry the same figures.
    body = httpx.get(f"http://127.0.0.1:{provider.json_port}/polykv/autoscale/{ns}/eng").json()
    assert body["floor_pressure"] == 0 and body["stale"] is False, body
    assert body["pools"]["crew"]["floor"] == 2.5  # a fractional floor, pushed as given
    scraped = httpx.get(f"http://127.0.0.1:{provider.op.metrics_port}/metrics").text
    assert f'polykv_engine_floor_pressure{{engine="eng",namespace="{ns}"}} 0.0' in scraped
    assert f'polykv_engine_session_demand_ratio{{engine="eng",namespace="{ns}"}} 0.0' in scraped
    # Each pod's deletion cost: the sessions it holds (none yet).
    costs = eventually("deletion cost", lambda: c if (c := pod_costs(k8s_cluster, ns)) else None)
    assert list(costs.values()) == ["0"], costs
    # The API server refuses a floor at or below 0, or not a number; 2.5 went in above.
    for bad in (0, -1, "fast"):
        out = k8s_cluster.kubectl(
            "apply", "--dry-run=server", "-n", ns, "-f", "-",
            input=json.dumps(policy_manifest(bad)), check=False,
        )  # fmt: skip
        assert out.returncode != 0 and "targetTpsPerSession" in out.stderr, (bad, out.stderr)


@pytest.mark.slow
def test_floor_pressure_scales_up_and_scale_down_removes_the_emptiest_replica_whole(
    k8s_cluster: ControlPlane, provider: Provider
) -> None:
    """Figures: time from load to the HPA's scale-up and to the new replica's Ready (only
    once its pool is on it); the scale-down takes the replica holding fewer sessions, and the
    turn running on it when it is deleted finishes."""
    ns = provider.namespace
    # A floor no session reaches on this CPU: any decoding session is under it.
    apply(k8s_cluster, ns, autoscaled_engine(4), pool_manifest("crew", text=CREW),
          policy_manifest(1e6))  # fmt: skip
    eventually("APIService Available", lambda: available(k8s_cluster), 90)
    eventually("engine Ready", lambda: ready(k8s_cluster, ns), 120)
    (a,) = replicas(k8s_cluster, ns)
    eng = EngineApi(k8s_cluster, ns)
    key = inference_key(k8s_cluster, ns)
    apply(k8s_cluster, ns, hpa_manifest())
    watch = PodWatch(k8s_cluster, ns)
    load = [Turns(a.ip, f"agent-{i}", "crew", key).start() for i in range(3)]
    t_load = time.time()
    try:
        high = until(
            k8s_cluster, ns, "floor pressure over its target",
            lambda: p if (p := value_or_none(k8s_cluster, "polykv_floor_pressure", ns)) else None,
            60,
        )  # fmt: skip
        until(k8s_cluster, ns, "HPA scales the engine to 2",
              lambda: spec_replicas(k8s_cluster, ns) == 2 or None, 120)  # fmt: skip
        t_scaled = time.time()
        both = eventually(
            "2 replicas", lambda: r if len(r := replicas(k8s_cluster, ns)) == 2 else None, 60
        )
        b = next(r for r in both if r.uid != a.uid)
        ready_at = eventually(
            "new replica Ready",
            lambda: watch.first(lambda o: is_pod(b.uid)(o) and condition(o, "Ready") == "True"),
            120,
        )
        assert eng.pools(b.ip)["crew"].created_ts < ready_at  # Ready only with its pool on it
    finally:
        for t in load:
            t.stop()
    assert high > 0.8
    assert all(t.outcome in ("done", "stopped") for w in load for t in w.turns), [
        w.turns for w in load
    ]
    print(
        f"\nautoscale figures: floor pressure {high:.0f}; load -> HPA scale-up "
        f"{t_scaled - t_load:.1f} s; load -> new replica Ready {ready_at - t_load:.1f} s"
    )

    # The load is gone. Replica a holds the three agents' sessions; b gets two sessions that
    # run turns back to back (unpooled: no floor) until b is removed. Each client reads its
    # stream slowly (1,200 events, ~2 s a turn: the test model decodes one in 0.3 s), so the
    # deletion lands inside a turn and not in the milliseconds between two. Two sessions, the
    # second half a turn behind: the deletion can still fall in one session's gap between
    # turns (or in the last few ms of one, which the 20 ms drain watch cannot tell apart), but
    # hardly in both sessions' at once.
    drains = [
        Turns(b.ip, f"drain-check-{i}", None, key, n_predict=1200, read_pause_s=0.002)
        for i in range(2)
    ]
    drain_watch = DrainWatch(b.ip).start()
    try:
        drains[0].start()
        eventually("half of the first drain turn", lambda: drains[0].reading >= 600 or None)
        drains[1].start()
        costs = until(
            k8s_cluster, ns, "deletion costs a=3, b=2",
            lambda: c if (c := pod_costs(k8s_cluster, ns)) == {a.pod: "3", b.pod: "2"} else None,
            60,
        )  # fmt: skip
        t_idle = time.time()
        until(k8s_cluster, ns, "HPA scales the engine back to 1",
              lambda: spec_replicas(k8s_cluster, ns) == 1 or None, 180)  # fmt: skip
        t_down = time.time()
        deleted_at = eventually(
            "a replica deleted",
            lambda: watch.first(lambda o: bool(o["metadata"].get("deletionTimestamp"))),
            60,
        )
        for d in drains:
            eventually(f"{d.session}'s turns end", d.finished, 120)
    finally:
        for d in drains:
            d.stop()
        drain_watch.stop()
        watch.stop()
    assert [r.uid for r in replicas(k8s_cluster, ns)] == [a.uid], costs  # the emptiest went
    turns = {d.session: d.turns for d in drains}
    for session_turns in turns.values():
        outcomes = [t.outcome for t in session_turns]
        assert "cut" not in outcomes and "stopped" not in outcomes, turns
        assert outcomes[-1] != "done", turns  # the last turn found b gone
    # b kept serving once it began draining: a turn in flight then ended whole after it.
    drained_at = drain_watch.began
    assert drained_at is not None and drained_at >= deleted_at - 1.0, (drained_at, deleted_at)
    assert any(t.end > drained_at and t.outcome == "done" for ts in turns.values() for t in ts), (
        drained_at,
        turns,
    )
    print(f"autoscale figures: idle -> HPA scale-down {t_down - t_idle:.1f} s (window 15 s)")


@pytest.mark.slow
def test_refused_sessions_scale_up_while_floor_pressure_stays_at_most_one(
    k8s_cluster: ControlPlane, provider: Provider
) -> None:
    """An enforced gate refuses new sessions, so the demand it turns away never shows in the
    floor pressure (at most 1 here); the demand ratio counts the refused (and a replica with
    no headroom left) and scales.

    The refusals come from the gate's KV-headroom arm: one agent runs turns that fill the
    context, and while it holds more than half of it a newcomer does not fit (decided by
    cells, not by speed, so the test does not depend on this shared CPU's pace). The floor
    is set at a tenth of the measured mean: the gate holds it with room to spare."""
    ns = provider.namespace
    apply(k8s_cluster, ns, autoscaled_engine(2), pool_manifest("crew", text=CREW))
    eventually("APIService Available", lambda: available(k8s_cluster), 90)
    eventually("engine Ready", lambda: ready(k8s_cluster, ns), 120)
    (a,) = replicas(k8s_cluster, ns)
    eng = EngineApi(k8s_cluster, ns)
    key = inference_key(k8s_cluster, ns)
    steady = Turns(a.ip, "steady", "crew", key, n_predict=1900).start()
    pressures: list[float] = []
    ratios: list[float] = []
    statuses: list[int] = []
    reasons: set[str] = set()
    try:
        tps = measured_tps(eng, a.ip)
        floor = round(0.1 * tps, 1)
        apply(k8s_cluster, ns, policy_manifest(floor, mode="enforced"))

        def enforced() -> bool | None:
            policy = eng.pools(a.ip)["crew"].admission
            return True if policy is not None and policy.mode == "enforced" else None

        eventually("policy on the replica", enforced, 60)
        apply(k8s_cluster, ns, hpa_manifest())
        signal = f"http://127.0.0.1:{provider.json_port}/polykv/autoscale/{ns}/eng"
        knocks = iter(range(10**6))
        scaled = threading.Event()  # the HPA reached 2 replicas (remembered once seen)
        sampling = threading.Event()

        def sample() -> None:
            # The signal four times a second, from the source the aggregator serves the HPA
            # (cheaper than kubectl, whose start-up would slow the engine down): the HPA
            # polls on its own clock, so the test must see the peaks it may have seen.
            while not sampling.is_set():
                body = httpx.get(signal, timeout=10).json()
                if not body["stale"]:
                    pressures.append(body["floor_pressure"])
                    ratios.append(body["session_demand_ratio"])
                sampling.wait(0.25)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        def knock() -> bool | None:
            for _ in range(4):  # new agents ask to join, each once
                r = httpx.post(
                    f"http://{a.ip}:8080/completion",
                    json={"prompt": CREW + " Join.", "pool_id": "crew", "n_predict": 4},
                    headers={
                        "x-session-id": f"newcomer-{next(knocks)}",
                        "Authorization": f"Bearer {key}",
                    },
                    timeout=120,
                )
                statuses.append(r.status_code)
                if r.status_code == 429:
                    reasons.add(r.json()["error"]["reason"])
            time.sleep(0.5)
            # A replica with no headroom left already reads as saturated (ratio 1), so the HPA
            # may scale while steady's turn is full and before a knock lands in one: knock on
            # until both have happened (CI saw four admitted knocks between two turns).
            if spec_replicas(k8s_cluster, ns) == 2:
                scaled.set()
            return True if scaled.is_set() and 429 in statuses else None

        try:
            until(k8s_cluster, ns, "HPA scales, and newcomers were refused", knock, 240)
        finally:
            sampling.set()
            sampler.join(30)
    finally:
        steady.stop()
    assert all(t.outcome in ("done", "stopped") for t in steady.turns), steady.turns
    assert statuses.count(429) > 0 and reasons <= {"kv_headroom", "tps_floor"}, (statuses, reasons)
    # The HPA read the demand ratio through the aggregator (its own status says what it saw).
    seen = hpa_metric(k8s_cluster, ns, "polykv_session_demand_ratio")
    why = (ratios, seen, pressures, hpa_says(k8s_cluster, ns))
    assert ratios and max(ratios) > 0.85 and seen is not None, why
    assert pressures and max(pressures) <= 1.0, (floor, tps, pressures)
    print(
        f"\nautoscale figures: floor {floor} tps (0.1 x measured {tps:.1f}); floor pressure "
        f"max {max(pressures):.2f}; demand ratio max {max(ratios):.2f}; "
        f"{statuses.count(429)} of {len(statuses)} newcomers refused ({sorted(reasons)})"
    )


def test_the_api_is_not_served_next_to_another_provider(
    k8s_cluster: ControlPlane,
    process_node: ProcessNode,
    namespace: str,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> None:
    """Another provider's APIService in the cluster: the operator does not serve (and does
    not touch it), and the chart refuses to install the provider."""
    k8s_cluster.kubectl(
        "apply", "-f", str(ROOT / "operator" / "deploy" / "external-metrics-rbac.yaml")
    )
    ca = pki.authority(tmp_path, "metrics")
    cert, key = pki.leaf(ca, tmp_path, "metrics", SERVICE, (f"{SERVICE}.{namespace}.svc",))
    foreign = desired("keda", "keda-operator-metrics-apiserver", 443, ca.cert.read_bytes())
    foreign["metadata"]["labels"] = {}
    k8s_cluster.apply(foreign)
    tls_port = free_port()
    env = {
        "POLYKV_OPERATOR_METRICS_ADDRESS": "127.0.0.1",
        "POLYKV_OPERATOR_EXTERNAL_METRICS_PORT": str(tls_port),
        "POLYKV_OPERATOR_EXTERNAL_METRICS_CERT": str(cert),
        "POLYKV_OPERATOR_EXTERNAL_METRICS_KEY": str(key),
        "POLYKV_OPERATOR_EXTERNAL_METRICS_SERVICE": f"{namespace}/{SERVICE}",
    }
    try:
        with operator_running(k8s_cluster, namespace, operator_kubeconfig, tmp_path, **env) as op:
            eventually(
                "the operator refuses",
                lambda: True if "belongs to another provider" in op.log() else None,
                60,
            )
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"https://127.0.0.1:{tls_port}/healthz", verify=False, timeout=5)
            after = k8s_cluster.api.get(APISERVICE)
            assert after["spec"]["service"]["namespace"] == "keda"  # untouched
        # Nor does the chart install it: its pre-install job (this code, with the job's
        # arguments) looks the APIService up and refuses, making no certificate.
        job = subprocess.run(
            [sys.executable, "-m", "polykv_operator.hooks", "external-metrics-tls",
             f"--namespace={namespace}", "--secret=em-cert", f"--service={SERVICE}"],
            env=k8s_cluster.tool_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        refusal = job.stderr
        assert job.returncode == 1, refusal
        assert "another external metrics provider" in refusal, refusal
        assert "keda/keda-operator-metrics-apiserver" in refusal, refusal
        assert (
            get_or_none(k8s_cluster.api, f"/api/v1/namespaces/{namespace}/secrets/em-cert") is None
        )
    finally:
        try:
            k8s_cluster.api.delete(APISERVICE)
        except ApiError as exc:
            if exc.status != 404:
                raise


def test_the_operator_changes_nothing_of_its_apiservice_but_the_ca_bundle(
    k8s_cluster: ControlPlane, namespace: str, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    """With the operator's token (external-metrics-rbac.yaml: patch on the one APIService,
    and the admission policy): the caBundle may be set; where the group is routed, its
    priority, its labels may not."""
    k8s_cluster.kubectl(
        "apply", "-f", str(ROOT / "operator" / "deploy" / "external-metrics-rbac.yaml")
    )
    k8s_cluster.apply(desired(namespace, SERVICE, 443))
    client = As(k8s_cluster, token_of(operator_kubeconfig))
    merge = "application/merge-patch+json"
    reroute = {"spec": {"service": {"namespace": "kube-system", "name": "evil", "port": 443}}}
    try:
        eventually(
            "the admission policy is in effect",
            lambda: (
                True
                if client.call("PATCH", f"{APISERVICE}?dryRun=All", reroute, merge).status_code
                == 403
                else None
            ),
            60,
        )
        ca = base64.b64encode(pki.authority(tmp_path, "em").cert.read_bytes()).decode()
        r = client.call("PATCH", APISERVICE, {"spec": {"caBundle": ca}}, merge)
        assert r.status_code == 200, r.text
        for bad in (
            reroute,
            {"spec": {"groupPriorityMinimum": 20000}},
            {"spec": {"insecureSkipTLSVerify": True, "caBundle": None}},
            {"metadata": {"labels": {"app.kubernetes.io/part-of": "other"}}},
        ):
            r = client.call("PATCH", APISERVICE, bad, merge)
            assert r.status_code == 403, (bad, r.text)
        live = k8s_cluster.api.get(APISERVICE)["spec"]
        assert live["service"]["namespace"] == namespace and live["caBundle"] == ca
    finally:
        client.http.close()
        k8s_cluster.kubectl(
            "delete", "apiservice", "v1beta1.external.metrics.k8s.io", "--wait=true",
            check=False, timeout_s=90,
        )  # fmt: skip
