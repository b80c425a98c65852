"""The operator writes only what its engine controls, on the real API server.

Objects another team made under the names an engine would use (its Deployment, Service and
admin Secret; a router's ServiceAccount, Role, RoleBinding, Deployment and Service) are
never patched or deleted: the engine turns Stalled naming them, and deleting the engine
leaves them as they were (same resourceVersion).
"""

from __future__ import annotations

from typing import Any

import pytest

from polykv_testenv import ControlPlane

from ..helpers import Obj, eventually, get_or_none, gone
from .test_operator import Operator, apply, engine_manifest, get, obj_path, reason

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
