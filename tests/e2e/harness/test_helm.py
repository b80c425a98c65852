"""`helm install` of a small chart against the local control plane."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from polykv_testenv import ControlPlane, ProcessNode

from ..helpers import eventually, gone

pytestmark = pytest.mark.k8s

CHART = Path(__file__).parent / "charts" / "smoke"


def test_helm_install_wait_and_uninstall(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    api = k8s_cluster.api
    # --wait needs the Deployment's pods Ready: the process node makes that real.
    k8s_cluster.helm(
        "install",
        "smoke",
        str(CHART),
        "-n",
        namespace,
        "--set",
        "message=hi there",
        "--wait",
        "--timeout",
        "90s",
    )
    status = json.loads(k8s_cluster.helm("status", "smoke", "-n", namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"

    cm = api.get(f"/api/v1/namespaces/{namespace}/configmaps/smoke-config")
    assert cm["data"]["message"] == "hi there"
    pods = api.get(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector="app.kubernetes.io/instance=smoke"
    )["items"]
    assert len(pods) == 1
    # The env var from the chart's ConfigMap reached the process.
    r = httpx.get(f"http://{pods[0]['status']['podIP']}:8080/env/MESSAGE", timeout=5)
    assert r.json()["value"] == "hi there"

    k8s_cluster.helm("uninstall", "smoke", "-n", namespace, "--wait", "--timeout", "60s")
    eventually(
        "chart objects removed",
        lambda: gone(api, f"/apis/apps/v1/namespaces/{namespace}/deployments/smoke-web"),
    )
    assert gone(api, f"/api/v1/namespaces/{namespace}/configmaps/smoke-config")
