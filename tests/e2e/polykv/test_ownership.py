"""The operator writes only what its engine controls, on the real API server.

Objects another team made under the names an engine would use (its Deployment, Service and
admin Secret; a router's ServiceAccount, Role, RoleBinding, Deployment and Service) are
never patched or deleted: the engine turns Stalled naming them, and deleting the engine
leaves them as they were (same resourceVersion). Pods that carry an engine's label without
being its own (owner chain pod -> ReplicaSet -> Deployment -> engine) are never polled,
gated or given a deletion cost.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polykv_operator.names import DELETION_COST
from polykv_testenv import ControlPlane

from ..helpers import Obj, eventually, get_or_none, gone
from .test_operator import (
    Operator,
    apply,
    engine_manifest,
    gate_of,
    get,
    obj_path,
    reason,
    wait_condition,
)

pytestmark = pytest.mark.k8s

LAST_HANDLED = "kopf.polykv.io/last-handled-configuration"
FOREIGN = {"team": "other"}


def foreign_objects(name: str, with_router_role: bool = True) -> list[Obj]:
    """What another team might have made under `name` (no ownerReference, their labels)."""
    meta = {"name": name, "labels": FOREIGN}
    out: list[Obj] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": FOREIGN},
                "template": {
                    "metadata": {"labels": FOREIGN},
                    "spec": {"containers": [{"name": "app", "image": "polykv/testserver:1"}]},
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {"selector": FOREIGN, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    ]
    if with_router_role:
        out += [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": meta,
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": meta,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "default"}],
            },
        ]
    else:
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {**meta, "name": f"{name}-polykv-admin"},
                "type": "Opaque",
                "stringData": {"admin-key": "theirs"},
            }
        )
    return out


def path_of(namespace: str, obj: Obj) -> str:
    plural = {
        "ServiceAccount": "serviceaccounts",
        "Deployment": "deployments",
        "Service": "services",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "Secret": "secrets",
    }[obj["kind"]]
    group = {"apps/v1": "/apis/apps/v1", "v1": "/api/v1"}.get(
        obj["apiVersion"], f"/apis/{obj['apiVersion']}"
    )
    return f"{group}/namespaces/{namespace}/{plural}/{obj['metadata']['name']}"


def snapshot(cluster: ControlPlane, namespace: str, objs: list[Obj]) -> dict[str, Any]:
    """resourceVersion, labels and ownerReferences of each object, by path."""
    out = {}
    for o in objs:
        path = path_of(namespace, o)
        live = cluster.api.get(path)
        meta = live["metadata"]
        out[path] = (meta["resourceVersion"], meta.get("labels"), meta.get("ownerReferences"))
    return out


def stalled_with(cluster: ControlPlane, namespace: str, engine: str, *names: str) -> Any:
    def probe() -> tuple[str, str] | None:
        obj = get_or_none(cluster.api, obj_path(namespace, "polykvengines", engine))
        if obj is None:
            return None
        why = reason(obj, "Stalled")
        conds = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions") or []}
        return why if conds.get("Stalled") == "True" and all(n in why[1] for n in names) else None

    return eventually(f"{engine} Stalled naming {names}", probe, 90)


def test_foreign_objects_of_the_same_names_are_never_changed_or_deleted(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    router_side = foreign_objects("web-router")
    engine_side = foreign_objects("api", with_router_role=False)
    apply(k8s_cluster, namespace, *router_side, *engine_side)
    before = snapshot(k8s_cluster, namespace, router_side + engine_side)

    # An engine with the router off would delete `web-router`'s objects on the old code.
    apply(k8s_cluster, namespace, engine_manifest("web", replicas=0))
    eventually(
        "web applied (its handler finished)",
        lambda: (
            True
            if LAST_HANDLED
            in get(k8s_cluster, namespace, "polykvengines", "web")["metadata"].get(
                "annotations", {}
            )
            else None
        ),
        90,
    )
    mine = k8s_cluster.api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/web")
    web_uid = get(k8s_cluster, namespace, "polykvengines", "web")["metadata"]["uid"]
    assert [r["uid"] for r in mine["metadata"]["ownerReferences"]] == [web_uid]
    assert snapshot(k8s_cluster, namespace, router_side + engine_side) == before

    # Turning its router on: every router name is taken, so nothing is written.
    k8s_cluster.kubectl(
        "patch", "polykvengine", "web", "-n", namespace, "--type=merge",
        "-p", '{"spec": {"router": {"enabled": true, "replicas": 0}}}',
    )  # fmt: skip
    why, message = stalled_with(
        k8s_cluster,
        namespace,
        "web",
        "ServiceAccount web-router",
        "Deployment web-router",
        "Service web-router",
    )
    assert why == "NameClash", (why, message)

    # An engine named after another team's Deployment, Service and a Secret.
    apply(k8s_cluster, namespace, engine_manifest("api", replicas=0))
    why, message = stalled_with(
        k8s_cluster, namespace, "api", "Deployment api", "Service api", "Secret api-polykv-admin"
    )
    assert why == "NameClash", (why, message)
    assert snapshot(k8s_cluster, namespace, router_side + engine_side) == before

    # Deleting both engines leaves every foreign object as it was.
    for name in ("web", "api"):
        k8s_cluster.kubectl("delete", "polykvengine", name, "-n", namespace, "--timeout=60s")
    eventually(
        "web's own Deployment collected",
        lambda: gone(k8s_cluster.api, f"/apis/apps/v1/namespaces/{namespace}/deployments/web"),
        60,
    )
    assert snapshot(k8s_cluster, namespace, router_side + engine_side) == before


def unschedulable_pod_spec() -> Obj:
    """A pod spec no node runs (its nodeSelector matches none), fit for restricted PSA."""
    return {
        "nodeSelector": {"polykv.io/no-such-node": "true"},
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "engine",
                "image": "polykv/testserver:1",
                "securityContext": {
                    "runAsUser": 65532,
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }


def rounds_done(operator: Operator) -> float:
    scrape = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(scrape)
        if fam.name == "polykv_operator_engine_rounds"
        for s in fam.samples
        if s.name.endswith("_total")
    )


def test_pods_that_only_carry_the_engine_label_are_never_touched(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    """Two foreign pods labelled polykv.io/engine=web: a bare one, and one whose controller
    is another team's ReplicaSet named like the engine's (web-<pod-template-hash>, which the
    admission policy cannot tell from the engine's own). Neither gets the readiness gate
    condition or a deletion cost, nor counts as a replica, while the engine's own pod
    turns Ready through the same operator."""
    hash_ = "f0re1gn"
    # The labels an engine pod has (anyone may set them): the second pod passes every rule
    # of the admission policy, only the operator's own owner check keeps it out.
    claimed = {
        "polykv.io/engine": "web",
        "app.kubernetes.io/name": "polykv-engine",
        "app.kubernetes.io/managed-by": "polykv-operator",
    }
    bare: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web-lookalike", "labels": {**claimed, **FOREIGN}},
        "spec": unschedulable_pod_spec(),
    }
    # Its own labels leave out the engine's, so that the engine's Deployment (selector:
    # the engine label) does not adopt it; its pods carry them. Its selector is not the
    # bare pod's labels, which it would adopt.
    theirs = {**FOREIGN, "set": hash_}
    replicaset: Obj = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": f"web-{hash_}", "labels": theirs},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": theirs},
            "template": {
                "metadata": {"labels": {**theirs, **claimed, "pod-template-hash": hash_}},
                "spec": unschedulable_pod_spec(),
            },
        },
    }
    apply(k8s_cluster, namespace, bare, replicaset)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    foreign = eventually(
        "the foreign ReplicaSet's pod",
        lambda: (
            [p["metadata"]["name"] for p in k8s_cluster.api.get(pods)["items"]]
            if len(k8s_cluster.api.get(pods)["items"]) == 2
            else None
        ),
        60,
    )

    apply(k8s_cluster, namespace, engine_manifest("web", replicas=1))
    engine = wait_condition(k8s_cluster, namespace, "polykvengines", "web", "Ready", 180)
    # A few more whole rounds with all three pods in the index.
    after = rounds_done(operator) + 3
    eventually("three more rounds", lambda: True if rounds_done(operator) >= after else None, 60)

    own = [p for p in k8s_cluster.api.get(pods)["items"] if p["metadata"]["name"] not in foreign]
    assert len(own) == 1 and gate_of(own[0]) == "True"
    status = get(k8s_cluster, namespace, "polykvengines", "web")["status"]
    listed = {r["pod"] for r in status["replicaStatus"]}
    assert listed == {own[0]["metadata"]["name"]}, (listed, engine["status"])
    for name in foreign:
        pod = k8s_cluster.api.get(f"{pods}/{name}")
        assert gate_of(pod) is None, pod["status"]
        assert DELETION_COST not in (pod["metadata"].get("annotations") or {}), pod["metadata"]


def test_a_router_binding_of_the_old_layout_is_replaced(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    """Operators before the shared router ClusterRole bound a Role of the engine's own under
    the router's name. A RoleBinding's roleRef cannot change, so the router's binding has a
    new name; the old binding, the engine's, is deleted (its Role goes with the engine)."""
    apply(k8s_cluster, namespace, engine_manifest("web", replicas=0))
    deployment = eventually(
        "web's Deployment",
        lambda: get_or_none(
            k8s_cluster.api, f"/apis/apps/v1/namespaces/{namespace}/deployments/web"
        ),
        90,
    )
    owner = deployment["metadata"]["ownerReferences"]  # the engine, as the controller
    labels = {
        "app.kubernetes.io/name": "polykv-router",
        "app.kubernetes.io/managed-by": "polykv-operator",
        "polykv.io/router": "web",
    }
    meta = {"name": "web-router", "labels": labels, "ownerReferences": owner}
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    k8s_cluster.api.create(
        f"{rbac}/roles",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}],
        },
    )
    k8s_cluster.api.create(
        f"{rbac}/rolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "web-router",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "web-router", "namespace": namespace}],
        },
    )
    k8s_cluster.kubectl(
        "patch", "polykvengine", "web", "-n", namespace, "--type=merge",
        "-p", '{"spec": {"router": {"enabled": true, "replicas": 0}}}',
    )  # fmt: skip
    binding = eventually(
        "the router's binding",
        lambda: get_or_none(k8s_cluster.api, f"{rbac}/rolebindings/web-router-pod-reader"),
        90,
    )
    assert binding["roleRef"]["kind"] == "ClusterRole"
    assert binding["subjects"][0]["name"] == "web-router"
    eventually(
        "the old binding deleted",
        lambda: gone(k8s_cluster.api, f"{rbac}/rolebindings/web-router"),
        60,
    )
    conds = get(k8s_cluster, namespace, "polykvengines", "web")["status"].get("conditions") or []
    assert {c["type"]: c["status"] for c in conds}.get("Stalled") != "True", conds
