"""Each engine's and router's NetworkPolicy, written by the operator beside them (as the
chart configures it), in the engine's own namespace whatever it is, on the real API
server and under the operator's own RBAC and admission policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polykv_testenv import ControlPlane, ProcessNode

from ..helpers import Obj, eventually, get_or_none, gone
from .test_operator import apply, engine_manifest, get, operator_running
from .test_ownership import FOREIGN, stalled_with
from .test_rbac import As, refused, token_of

pytestmark = pytest.mark.k8s

AGENTS = {"podSelector": {"matchLabels": {"polykv.io/agent": "true"}}}
API = {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": [{"port": 6443, "protocol": "TCP"}]}
DNS = {"ports": [{"port": 53, "protocol": "UDP"}]}
CONFIG = {
    "ingress": [AGENTS],
    "egress": [DNS],
    "modelEgress": [{"ports": [{"port": 443, "protocol": "TCP"}]}],
    "routerIngress": [AGENTS],
    "routerEgress": [API, DNS],
}


def policy_path(namespace: str, name: str = "") -> str:
    return f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/{name}"


def test_every_engine_and_router_gets_its_policy_where_it_is(
    k8s_cluster: ControlPlane,
    process_node: ProcessNode,
    namespace: str,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> None:
    env = {"POLYKV_OPERATOR_NETWORK_POLICY": json.dumps(CONFIG)}
    with operator_running(k8s_cluster, namespace, operator_kubeconfig, tmp_path, **env):
        engine = engine_manifest("web", replicas=0)  # its model comes from an init container
        engine["spec"]["router"] = {"enabled": True, "replicas": 0}
        apply(k8s_cluster, namespace, engine)
        mine = eventually(
            "web's NetworkPolicy",
            lambda: get_or_none(k8s_cluster.api, policy_path(namespace, "web")),
            90,
        )
        router = eventually(
            "web-router's NetworkPolicy",
            lambda: get_or_none(k8s_cluster.api, policy_path(namespace, "web-router")),
            90,
        )
        uid = get(k8s_cluster, namespace, "polykvengines", "web")["metadata"]["uid"]
        for p in (mine, router):
            (owner,) = p["metadata"]["ownerReferences"]
            assert owner["uid"] == uid and owner["controller"] is True
        assert mine["spec"]["podSelector"] == {"matchLabels": {"polykv.io/engine": "web"}}
        assert mine["spec"]["ingress"][0]["ports"] == [{"port": 8080, "protocol": "TCP"}]
        assert mine["spec"]["egress"] == [DNS, *CONFIG["modelEgress"]]  # an init container
        assert router["spec"]["podSelector"] == {"matchLabels": {"polykv.io/router": "web"}}
        assert router["spec"]["egress"][1:] == [API, DNS]

        # The router off: its policy goes with its other objects; the engine's stays.
        k8s_cluster.kubectl(
            "patch", "polykvengine", "web", "-n", namespace, "--type=merge",
            "-p", '{"spec": {"router": {"enabled": false}}}',
        )  # fmt: skip
        eventually(
            "web-router's policy deleted",
            lambda: gone(k8s_cluster.api, policy_path(namespace, "web-router")),
            60,
        )
        assert get_or_none(k8s_cluster.api, policy_path(namespace, "web")) is not None

        # Another team's policy under an engine's name: the engine stalls, theirs stays.
        theirs = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "api", "labels": FOREIGN},
            "spec": {"podSelector": {"matchLabels": FOREIGN}, "policyTypes": ["Ingress"]},
        }
        apply(k8s_cluster, namespace, theirs)
        before = k8s_cluster.api.get(policy_path(namespace, "api"))["metadata"]
        apply(k8s_cluster, namespace, engine_manifest("api", replicas=0))
        why, _ = stalled_with(k8s_cluster, namespace, "api", "NetworkPolicy api")
        assert why == "NameClash"
        after = k8s_cluster.api.get(policy_path(namespace, "api"))["metadata"]
        assert after["resourceVersion"] == before["resourceVersion"]
        assert "ownerReferences" not in after


def test_the_operator_cannot_fence_pods_that_are_not_its_engines(
    k8s_cluster: ControlPlane, namespace: str, operator_kubeconfig: Path
) -> None:
    """With the operator's token: a NetworkPolicy selects only the pods of the engine (or
    router) it is named after."""
    client = As(k8s_cluster, token_of(operator_kubeconfig))
    path = policy_path(namespace)
    labels = {"app.kubernetes.io/managed-by": "polykv-operator"}

    def policy(name: str, selector: Obj) -> Obj:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": name, "labels": labels},
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"]},
        }

    try:
        eventually(
            "the admission policy is in effect",
            lambda: (
                True
                if refused(client.call("POST", f"{path}?dryRun=All", policy("web", {})))
                else None
            ),
            60,
        )
        for name, selector in (
            ("web", {}),  # every pod of the namespace
            ("web", {"matchLabels": {"app": "theirs"}}),
            ("web", {"matchLabels": {"polykv.io/engine": "api"}}),  # another engine
            ("web-router", {"matchLabels": {"polykv.io/router": "api"}}),
        ):
            r = client.call("POST", path, policy(name, selector))
            assert refused(r), (name, selector, r.text)
        for name, selector in (
            ("web", {"matchLabels": {"polykv.io/engine": "web"}}),
            ("web-router", {"matchLabels": {"polykv.io/router": "web"}}),
        ):
            r = client.call("POST", path, policy(name, selector))
            assert r.status_code == 201, r.text
    finally:
        client.http.close()
