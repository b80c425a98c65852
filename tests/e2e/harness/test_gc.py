"""ownerReference garbage collection by the real kube-controller-manager."""

from __future__ import annotations

import time
from functools import partial

import pytest

from polykv_testenv import ApiError, ControlPlane, Kube

from ..helpers import Obj, eventually, fetch_if, get_or_none, gone

pytestmark = pytest.mark.k8s

HOLD = "smoke.polykv.io/hold"


def configmap(name: str, owner: Obj | None = None, finalizers: list[str] | None = None) -> Obj:
    meta: Obj = {"name": name}
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "blockOwnerDeletion": True,
            }
        ]
    if finalizers:
        meta["finalizers"] = finalizers
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": name}}


def cm_path(ns: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{ns}/configmaps" + (f"/{name}" if name else "")


def delete(api: Kube, path: str, policy: str) -> None:
    api.delete(path, {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": policy})


def drop_finalizer(api: Kube, path: str, finalizer: str) -> bool | None:
    """Optimistic update of the finalizer list; None (retry) when someone else wrote first."""
    obj = api.get(path)
    rest = [f for f in obj["metadata"].get("finalizers") or [] if f != finalizer]
    try:
        api.patch(
            path,
            {
                "metadata": {
                    "finalizers": rest,
                    "resourceVersion": obj["metadata"]["resourceVersion"],
                }
            },
        )
    except ApiError as exc:
        if exc.status == 409:
            return None
        raise
    return True


def test_background_deletion_removes_dependents(k8s_cluster: ControlPlane, namespace: str) -> None:
    api = k8s_cluster.api
    owner = api.create(cm_path(namespace), configmap("owner"))
    for i in range(3):
        api.create(cm_path(namespace), configmap(f"child-{i}", owner))
    grandchild_owner = api.get(cm_path(namespace, "child-0"))
    api.create(cm_path(namespace), configmap("grandchild", grandchild_owner))

    delete(api, cm_path(namespace, "owner"), "Background")

    assert get_or_none(api, cm_path(namespace, "owner")) is None  # gone at once
    for name in ("child-0", "child-1", "child-2", "grandchild"):
        eventually(f"{name} collected", partial(gone, api, cm_path(namespace, name)))


def test_foreground_deletion_waits_for_dependents(
    k8s_cluster: ControlPlane, namespace: str
) -> None:
    api = k8s_cluster.api
    owner = api.create(cm_path(namespace), configmap("owner"))
    # The finalizer keeps the dependent (and so, in foreground, the owner) around.
    api.create(cm_path(namespace), configmap("held", owner, finalizers=[HOLD]))
    api.create(cm_path(namespace), configmap("free", owner))

    delete(api, cm_path(namespace, "owner"), "Foreground")

    def owner_in_foreground_deletion() -> Obj | None:
        obj = get_or_none(api, cm_path(namespace, "owner"))
        if obj and "foregroundDeletion" in (obj["metadata"].get("finalizers") or []):
            return obj
        return None

    eventually("owner in foreground deletion", owner_in_foreground_deletion)
    eventually("unblocked dependent collected", lambda: gone(api, cm_path(namespace, "free")))
    held = eventually(
        "held dependent marked for deletion",
        lambda: fetch_if(
            api, cm_path(namespace, "held"), lambda d: d["metadata"].get("deletionTimestamp")
        ),
    )
    time.sleep(2)  # the owner must still be waiting for "held"
    owner_now = get_or_none(api, cm_path(namespace, "owner"))
    assert owner_now is not None and owner_now["metadata"].get("deletionTimestamp")

    assert HOLD in held["metadata"]["finalizers"]
    eventually("hold released", lambda: drop_finalizer(api, cm_path(namespace, "held"), HOLD))
    eventually("held dependent gone", lambda: gone(api, cm_path(namespace, "held")))
    eventually("owner gone last", lambda: gone(api, cm_path(namespace, "owner")))
