"""polykv-router on the real control plane: three engine replicas as pods, the router
deployed by the real operator (spec.router) under its own ServiceAccount, both found by
watching pods (their loopback addresses cannot be Endpoints here).

One fleet serves the whole module (starting it is most of the cost); each test uses its own
pools and session ids, and the tests that take the fleet apart (a router restart, a deleted
engine pod) run last.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from polykv_testenv import ControlPlane, ProcessNode
from polykv_testenv.waiting import wait_for

from ...router.helpers import (
    PREFIX,
    assert_same_stream,
    create_pool,
    metrics,
    pool_prefix,
    saturate,
    total,
)
from ..helpers import Obj, eventually, get_or_none
from .test_operator import (
    EngineApi,
    Operator,
    apply,
    engine_manifest,
    forbidden_lines,
    operator_kubeconfig,
    pool_manifest,
    replicas,
)

pytestmark = pytest.mark.k8s

__all__ = ["operator_kubeconfig"]  # a fixture, used by `routed`

REPLICAS = 3
SYSTEM = {"role": "system", "content": PREFIX}


@dataclass
class Routed:
    cluster: ControlPlane
    node: ProcessNode
    namespace: str
    operator: Operator
    api: EngineApi

    def router_pod(self) -> Obj:
        def ready() -> Obj | None:
            pods = self.cluster.api.get(
                f"/api/v1/namespaces/{self.namespace}/pods", labelSelector="polykv.io/router=eng"
            )["items"]
            for p in pods:
                conds = {c["type"]: c["status"] for c in p["status"].get("conditions") or []}
                if conds.get("Ready") == "True" and not p["metadata"].get("deletionTimestamp"):
                    return dict(p)
            return None

        return eventually("router pod Ready", ready, 120)

    @property
    def router(self) -> str:
        return f"http://{self.router_pod()['status']['podIP']}:8080"

    def engines(self) -> dict[str, str]:
        """Serving engine pods: name -> base URL."""
        return {r.pod: f"http://{r.ip}:8080" for r in replicas(self.cluster, self.namespace)}

    def engine(self, pod: str) -> httpx.Client:
        return httpx.Client(base_url=self.engines()[pod], headers=self.api.headers, timeout=120)

    def hand_pool(self, name: str) -> None:
        """A pool made on every replica through the engine API (not a PolyKVPool): the
        operator leaves its admission policy alone, so a test can set one per replica."""
        for pod in self.engines():
            create_pool(self.engine(pod), name)

    def router_log(self) -> str:
        pod = self.router_pod()["metadata"]["name"]
        runner = self.node.runner(self.namespace, pod)
        assert runner is not None
        return "".join(p.read_text(errors="replace") for p in sorted(runner.dir.rglob("*.log")))


@pytest.fixture(scope="module")
def routed(
    k8s_cluster: ControlPlane,
    process_node: ProcessNode,
    operator_kubeconfig: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Routed]:
    namespace = "t-router"
    k8s_cluster.kubectl("create", "namespace", namespace)
    k8s_cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    logs = tmp_path_factory.mktemp("router-operator")
    op = Operator(k8s_cluster, namespace, operator_kubeconfig, logs).start()
    engine = engine_manifest(replicas=REPLICAS)
    engine["spec"]["contextSize"] = 8192
    engine["spec"]["router"] = {"enabled": True, "pollIntervalMs": 250}
    apply(k8s_cluster, namespace, engine, pool_manifest("crew", messages=[SYSTEM]))
    eventually(
        f"{REPLICAS} engine replicas Ready",
        lambda: True if len(ready_engines(k8s_cluster, namespace)) == REPLICAS else None,
        180,
    )
    fleet = Routed(k8s_cluster, process_node, namespace, op, EngineApi(k8s_cluster, namespace))
    KEY.update(fleet.api.headers)
    fleet.router_pod()
    try:
        yield fleet
        assert not re.search(r"forbidden", op.log(), re.IGNORECASE), forbidden_lines(op.log())
    finally:
        k8s_cluster.kubectl(
            "delete", "polykvpools,polykvengines", "--all", "-n", namespace, "--timeout=60s",
            check=False, timeout_s=90,
        )  # fmt: skip
        op.stop()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        print(f"operator logs: {logs}")


def ready_engines(cluster: ControlPlane, namespace: str) -> list[str]:
    pods = cluster.api.get(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector="polykv.io/engine=eng"
    )["items"]
    return [
        p["metadata"]["name"]
        for p in pods
        if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
        and not p["metadata"].get("deletionTimestamp")
    ]


KEY: dict[str, str] = {}  # the engines' key (the admin key: these engines have no API key)


def chat(base: str, session: str, pool: str, history: list[Obj], **kw: Any) -> httpx.Response:
    body = {"pool_id": pool, "messages": history, "max_tokens": 4, "temperature": 0, **kw}
    headers = {**KEY, "x-session-id": session}
    return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def say(base: str, session: str, pool: str, text: str) -> httpx.Response:
    """A turn in a pool made by hand (a raw prompt: the pool's prefix, then the session's
    whole history so far)."""
    body = {
        "pool_id": pool,
        "prompt": f"{pool_prefix(pool)} {text}",
        "n_predict": 4,
        "temperature": 0,
    }
    headers = {**KEY, "x-session-id": session}
    return httpx.post(base + "/completion", json=body, headers=headers, timeout=120)


# ------------------------------------------------------------------------------- tests


def test_the_operator_deploys_a_router_that_finds_the_engine_pods(routed: Routed) -> None:
    ns = f"/api/v1/namespaces/{routed.namespace}"
    api = routed.cluster.api
    # Owned by the engine, and allowed exactly what it needs.
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    bindings = f"{rbac}/namespaces/{routed.namespace}/rolebindings"
    binding = api.get(f"{bindings}/eng-router-pod-reader")
    assert binding["roleRef"]["kind"] == "ClusterRole"
    role = api.get(f"{rbac}/clusterroles/{binding['roleRef']['name']}")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    for path in (f"{ns}/services/eng-router", f"{ns}/serviceaccounts/eng-router"):
        owner = api.get(path)["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("PolyKVEngine", "eng")
    # No Endpoints here (loopback pod addresses): the router found the pods by watching them.
    ready = httpx.get(routed.router + "/readyz", timeout=30).json()
    assert ready["replicas"]["serving"] == REPLICAS
    assert not ((get_or_none(api, f"{ns}/endpoints/eng") or {}).get("subsets") or [])
    log = routed.router_log()
    assert "engine pods listed" in log and not re.search("forbidden|HTTP 403", log), log[-2000:]
    first = json.loads(log.splitlines()[0])  # structured: one JSON object per line
    assert first["msg"] == "polykv-router started" and first["selector"] == "polykv.io/engine=eng"


def test_new_sessions_spread_by_headroom_and_avoid_a_saturated_replica(routed: Routed) -> None:
    # The first test to place sessions, so the replicas start alike (no cached sessions of
    # other tests holding KV or counted as load): an even spread is what the picker owes.
    routed.hand_pool("spread")
    homes = Counter(
        say(routed.router, f"spread-{i}", "spread", "Go.").headers["x-polykv-replica"]
        for i in range(2 * REPLICAS)
    )
    if sorted(homes.values()) != [2] * REPLICAS:  # even: the pool's sessions count
        caps = {
            p: routed.engine(p).get("/polykv/pools/spread/capacity").json()
            for p in routed.engines()
        }
        raise AssertionError(f"{homes}; capacities now: {caps}")

    routed.hand_pool("avoid")
    full = sorted(routed.engines())[0]
    saturate(routed.engine(full), "avoid", settle_max_ms=4000)
    before = total(metrics(routed.engines()[full]), "polykv_pool_rejects_total", pool="avoid")
    homes = Counter(
        say(routed.router, f"avoid-{i}", "avoid", "Go.").headers["x-polykv-replica"]
        for i in range(REPLICAS)
    )
    assert full not in homes, homes
    # Not even tried: the router knew from the replica's capacity that it would refuse.
    after = total(metrics(routed.engines()[full]), "polykv_pool_rejects_total", pool="avoid")
    assert after == before


def test_twenty_turns_stay_on_one_replica_reusing_the_cache(routed: Routed) -> None:
    history: list[Obj] = [SYSTEM]
    seen: set[str] = set()
    cached: list[int] = []
    prompts: list[int] = []
    for turn in range(20):
        history.append({"role": "user", "content": f"Step {turn}: next source?"})
        r = chat(routed.router, "agent-20", "crew", history)
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-polykv-replica"])
        out = r.json()
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[-1] == out["timings"]["cache_n"]
        prompts.append(out["usage"]["prompt_tokens"])
        history.append(out["choices"][0]["message"])
    assert len(seen) == 1, seen
    assert cached[0] > 0  # the pool's prefix, from the first turn
    for k in range(1, 20):
        # Every turn reuses at least the whole previous prompt: the same slot, its own KV.
        assert cached[k] > cached[k - 1] and cached[k] >= prompts[k - 1], (k, cached, prompts)
    text = metrics(routed.router)
    assert total(text, "polykv_router_rehomes_total") == 0
    assert total(text, "polykv_router_session_lookups_total", result="not_found") >= 1


def test_a_stream_through_the_router_matches_a_direct_one(routed: Routed) -> None:
    body = {
        "prompt": PREFIX,
        "n_predict": 24,
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
    }
    url = routed.router + "/completion"
    with httpx.stream("POST", url, json=body, headers=KEY, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        via = r.read()
        pod = r.headers["x-polykv-replica"]
    url = routed.engines()[pod] + "/completion"
    with httpx.stream("POST", url, json=body, headers=KEY, timeout=120) as r:
        direct = r.read()
    assert_same_stream(direct, via, tokens=24)


def test_engine_refusals_become_one_429_with_the_smallest_retry_after(routed: Routed) -> None:
    routed.hand_pool("full")
    pods = sorted(routed.engines())
    for pod, settle_ms in zip(pods, (7000, 3000, 5000), strict=True):
        saturate(routed.engine(pod), "full", settle_max_ms=settle_ms)
    before = {
        p: total(metrics(routed.engines()[p]), "polykv_pool_rejects_total", pool="full")
        for p in pods
    }
    r = say(routed.router, "full-new", "full", "Go.")
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "3"
    assert r.json()["error"]["reason"] == "tps_floor"
    for p in pods:  # each replica was tried once, and refused
        got = total(metrics(routed.engines()[p]), "polykv_pool_rejects_total", pool="full")
        assert got == before[p] + 1, p
    text = metrics(routed.router)
    assert total(text, "polykv_router_fleet_rejects_total", reason="tps_floor") >= 1
    assert total(text, "polykv_router_placements_total", result="rejected") >= 1


def test_a_restarted_router_sends_continuations_to_their_replicas(routed: Routed) -> None:
    routed.hand_pool("keep")
    homes = {}
    for i in range(REPLICAS):
        r = say(routed.router, f"keep-{i}", "keep", "First.")
        homes[f"keep-{i}"] = r.headers["x-polykv-replica"]
    old = routed.router_pod()["metadata"]
    routed.cluster.kubectl("delete", "pod", old["name"], "-n", routed.namespace)
    eventually(
        "a new router pod",
        lambda: routed.router_pod()["metadata"]["uid"] != old["uid"] or None,
        120,
    )
    base = routed.router
    for session, home in homes.items():
        r = say(base, session, "keep", "First. Second.")
        assert r.status_code == 200, r.text
        assert r.headers["x-polykv-replica"] == home
        assert r.json()["timings"]["cache_n"] > 0
    text = metrics(base)
    assert total(text, "polykv_router_session_lookups_total", result="found") == REPLICAS
    assert total(text, "polykv_router_rehomes_total") == 0


def test_deleting_the_bound_pod_rehomes_the_next_turn_past_the_gate(routed: Routed) -> None:
    routed.hand_pool("move")
    r = say(routed.router, "mover", "move", "Step 1.")
    assert r.status_code == 200
    home = r.headers["x-polykv-replica"]
    others = sorted(p for p in routed.engines() if p != home)
    # Every other replica refuses new sessions: the next turn can land only ungated.
    for pod in others:
        saturate(routed.engine(pod), "move", settle_max_ms=4000)
    rejects = {p: total(metrics(routed.engines()[p]), "polykv_pool_rejects_total") for p in others}
    urls = routed.engines()
    base = routed.router
    routed.cluster.kubectl("delete", "pod", home, "-n", routed.namespace, "--wait=false")
    wait_for(
        "the deleted replica out of service",
        lambda: True if home not in ready_engines(routed.cluster, routed.namespace) else None,
        60,
    )
    r = say(base, "mover", "move", "Step 1. Step 2.")
    assert r.status_code == 200, r.text
    landed = r.headers["x-polykv-replica"]
    assert landed in others
    assert total(metrics(base), "polykv_router_rehomes_total") == 1
    there = metrics(urls[landed])
    assert total(there, "polykv_pool_rehomed_sessions_total", pool="move") == 1
    assert total(there, "polykv_pool_rejects_total") == rejects[landed]
    # Rebound: the turn after stays there.
    again = say(base, "mover", "move", "Step 1. Step 2. Step 3.")
    assert again.headers["x-polykv-replica"] == landed
    assert again.json()["timings"]["cache_n"] > 0


def test_the_router_goes_when_spec_router_is_turned_off(routed: Routed) -> None:
    patch = {"spec": {"router": {"enabled": False}}}
    routed.cluster.kubectl(
        "patch",
        "polykvengine",
        "eng",
        "-n",
        routed.namespace,
        "--type=merge",
        "-p",
        yaml.safe_dump(patch),
    )
    ns = f"/api/v1/namespaces/{routed.namespace}"
    paths = (
        f"{ns}/services/eng-router",
        f"{ns}/serviceaccounts/eng-router",
        f"/apis/apps/v1/namespaces/{routed.namespace}/deployments/eng-router",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{routed.namespace}/rolebindings/"
        "eng-router-pod-reader",
    )
    eventually(
        "router objects deleted",
        lambda: True if all(get_or_none(routed.cluster.api, p) is None for p in paths) else None,
        60,
    )
