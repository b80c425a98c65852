"""A pod readiness gate keeps Ready=False until its condition is patched True."""

from __future__ import annotations

import time

import pytest

from polykv_testenv import ControlPlane, ProcessNode
from polykv_testenv.kubeapi import STRATEGIC_PATCH

from ..helpers import Obj, condition, eventually, web_container

pytestmark = pytest.mark.k8s

GATE = "polykv.io/pools-ready"


def test_readiness_gate_holds_ready_until_true(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    api = k8s_cluster.api
    path = f"/api/v1/namespaces/{namespace}/pods/gated"
    pod: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated"},
        "spec": {
            "readinessGates": [{"conditionType": GATE}],
            "containers": [web_container()],
        },
    }
    api.create(f"/api/v1/namespaces/{namespace}/pods", pod)

    eventually(
        "containers ready", lambda: condition(api.get(path), "ContainersReady") == "True" or None
    )
    # The probe passes, yet the gate's condition is missing: not Ready, and it stays so.
    for _ in range(10):
        got = api.get(path)
        assert condition(got, "Ready") == "False"
        time.sleep(0.2)
    ready = next(c for c in got["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ReadinessGatesNotReady"

    def set_gate(status: str) -> None:
        patch = {"status": {"conditions": [{"type": GATE, "status": status}]}}
        api.patch(f"{path}/status", patch, content_type=STRATEGIC_PATCH)

    set_gate("False")
    time.sleep(1)
    assert condition(api.get(path), "Ready") == "False"

    set_gate("True")
    eventually("Ready after the gate", lambda: condition(api.get(path), "Ready") == "True" or None)
    # The node's status writes keep the gate condition written by someone else.
    time.sleep(1.5)
    got = api.get(path)
    assert condition(got, GATE) == "True" and condition(got, "Ready") == "True"

    set_gate("False")
    eventually(
        "not Ready once the gate drops",
        lambda: condition(api.get(path), "Ready") == "False" or None,
    )
