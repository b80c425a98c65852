"""Fault injection through the harness: the cluster and the node survive an API server
restart (what the operator's reliability tests build on)."""

from __future__ import annotations

import pytest

from polykv_testenv import ControlPlane, ProcessNode

from ..helpers import Obj, eventually, fetch_if, is_ready, web_container

pytestmark = pytest.mark.k8s


def test_node_recovers_after_an_api_server_restart(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    api = k8s_cluster.api
    pods = f"/api/v1/namespaces/{namespace}/pods"
    before: Obj = {"metadata": {"name": "before"}, "spec": {"containers": [web_container()]}}
    api.create(pods, before)
    eventually("first pod Ready", lambda: fetch_if(api, f"{pods}/before", is_ready))
    pid = process_node.pid(namespace, "before")

    k8s_cluster.restart_component("kube-apiserver")

    # The running pod is untouched, and the node's watch picks up new work.
    assert process_node.pid(namespace, "before") == pid
    after: Obj = {"metadata": {"name": "after"}, "spec": {"containers": [web_container()]}}
    api.create(pods, after)
    eventually("second pod Ready", lambda: fetch_if(api, f"{pods}/after", is_ready))
    api.delete(f"{pods}/before")
    eventually("first pod deleted", lambda: fetch_if(api, pods, lambda p: len(p["items"]) == 1))
