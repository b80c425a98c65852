"""Argo CD's health (the chart's Lua) and kstatus (sigs.k8s.io/cli-utils) on objects in
every state the real operator puts them in: Ready, Reconciling, Stalled, being deleted, a
spec newer than its status, no status at all, an engine scaled to zero.

With POLYKV_HEALTH_CAPTURE=FILE the captured objects are written there as well
(tests/helm/fixtures/status_objects.json was written this way; tests/helm reads it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from polykv_testenv import ControlPlane

from ...helm.health import EXPECTED, argocd_health, kstatus
from ..helpers import Obj, condition, eventually, get_or_none
from .test_operator import (  # noqa: F401  (fixtures)
    SYSTEM,
    Operator,
    apply,
    engine_manifest,
    get,
    obj_path,
    operator,
    operator_kubeconfig,
    pool_manifest,
    wait_condition,
)

pytestmark = pytest.mark.k8s


def strip(obj: Obj) -> Obj:
    """What a tool reads: no managedFields noise."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
    return {**obj, "metadata": meta}


def test_every_state_computes_as_intended(
    k8s_cluster: ControlPlane,
    namespace: str,
    operator: Operator,  # noqa: F811  (the fixture imported above)
) -> None:
    policy = {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "AdmissionPolicy",
        "metadata": {"name": "floor"},
        "spec": {"poolRefs": [{"name": "crew"}], "targetTpsPerSession": 1, "mode": "advisory"},
    }
    apply(
        k8s_cluster,
        namespace,
        engine_manifest("eng"),
        engine_manifest("idle", replicas=0),
        pool_manifest("crew", messages=[SYSTEM], pin=True),
        pool_manifest("waiting", engine="idle", text="no replica will ever hold this"),
        pool_manifest("bad", parent="crew", messages=[SYSTEM], branchPos=100000),
        policy,
    )
    captured: dict[str, Any] = {}
    captured["ready-engine"] = wait_condition(
        k8s_cluster, namespace, "polykvengines", "eng", "Ready"
    )
    captured["ready-pool"] = wait_condition(k8s_cluster, namespace, "polykvpools", "crew", "Ready")
    captured["ready-policy"] = wait_condition(
        k8s_cluster, namespace, "admissionpolicies", "floor", "Ready"
    )
    captured["reconciling-pool"] = wait_condition(
        k8s_cluster, namespace, "polykvpools", "waiting", "Reconciling"
    )
    captured["stalled-pool"] = wait_condition(
        k8s_cluster, namespace, "polykvpools", "bad", "Stalled", timeout_s=120
    )
    captured["suspended-engine"] = wait_condition(
        k8s_cluster, namespace, "polykvengines", "idle", "Ready"
    )

    # With the operator away: a spec it has not seen, a delete it has not finished, an
    # object it has never seen.
    operator.stop()
    api = k8s_cluster.api
    api.patch(obj_path(namespace, "polykvengines", "eng"), {"spec": {"parallel": 3}})
    captured["stale-generation-engine"] = get(k8s_cluster, namespace, "polykvengines", "eng")
    k8s_cluster.kubectl("delete", "polykvpool", "waiting", "-n", namespace, "--wait=false")
    captured["deleting-pool"] = eventually(
        "pool marked for deletion",
        lambda: (
            o
            if (o := get_or_none(api, obj_path(namespace, "polykvpools", "waiting")))
            and o["metadata"].get("deletionTimestamp")
            else None
        ),
    )
    apply(k8s_cluster, namespace, pool_manifest("fresh", text="nobody has looked at me"))
    captured["no-status-pool"] = get(k8s_cluster, namespace, "polykvpools", "fresh")

    objs = {state: strip(obj) for state, obj in captured.items()}
    assert condition(objs["stalled-pool"], "Stalled") == "True"
    assert "status" not in objs["no-status-pool"]
    target = os.environ.get("POLYKV_HEALTH_CAPTURE")
    if target:
        Path(target).write_text(json.dumps(objs, indent=1, sort_keys=True) + "\n")

    names = list(objs)
    ks = dict(zip(names, kstatus([objs[n] for n in names]), strict=True))
    got = {n: (argocd_health(objs[n])[0], ks[n][0]) for n in names}
    assert got == EXPECTED, {n: (argocd_health(objs[n]), ks[n]) for n in names}
    assert "blocked by finalizers: polykv.io/finalizer" in argocd_health(objs["deleting-pool"])[1]
    assert "BranchPosOutOfRange" in argocd_health(objs["stalled-pool"])[1]
