"""Deployment -> ReplicaSet -> Pod -> a real process on the process node."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Collection

import httpx
import pytest

from polykv_testenv import ControlPlane, Kube, ProcessNode

from ..helpers import Obj, condition, eventually, get_or_none, gone, pid_alive, web_container

pytestmark = pytest.mark.k8s


def deployment(name: str) -> Obj:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [web_container()],
                },
            },
        },
    }


def owner_of(obj: Obj) -> tuple[str, str]:
    ref = obj["metadata"]["ownerReferences"][0]
    return ref["kind"], ref["name"]


def ready_pod(api: Kube, ns: str, exclude: Collection[str] = ()) -> Obj | None:
    pods: list[Obj] = api.get(f"/api/v1/namespaces/{ns}/pods", labelSelector="app=web")["items"]
    for p in pods:
        if p["metadata"]["name"] in exclude or p["metadata"].get("deletionTimestamp"):
            continue
        if p["status"].get("phase") == "Running" and condition(p, "Ready") == "True":
            return p
    return None


def answer(pod: Obj) -> Obj:
    r = httpx.get(f"http://{pod['status']['podIP']}:8080/", timeout=5)
    r.raise_for_status()
    body: Obj = r.json()
    return body


def test_deployment_runs_a_process_that_restarts_and_stops(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    api = k8s_cluster.api
    k8s_cluster.apply(deployment("web"), namespace)

    pod = eventually("pod Running and Ready", lambda: ready_pod(api, namespace))
    name = pod["metadata"]["name"]
    kind, rs_name = owner_of(pod)
    assert kind == "ReplicaSet"
    rs = api.get(f"/apis/apps/v1/namespaces/{namespace}/replicasets/{rs_name}")
    assert owner_of(rs) == ("Deployment", "web")
    assert pod["spec"]["nodeName"] == process_node.name
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    for ctype in ("Initialized", "ContainersReady", "Ready"):
        assert condition(pod, ctype) == "True"
    state = pod["status"]["containerStatuses"][0]
    assert state["ready"] and "running" in state["state"] and state["restartCount"] == 0

    # A real process answers on the pod's own address.
    body = answer(pod)
    assert body["hostname"] == name and body["host"] == ip
    pid = process_node.pid(namespace, name)
    assert pid is not None and pid == body["pid"]

    eventually(
        "deployment available",
        lambda: (
            api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/web")["status"].get(
                "availableReplicas"
            )
            == 1
            or None
        ),
    )

    # Killing the process: the node restarts it and counts the restart.
    os.kill(pid, signal.SIGKILL)

    def restarted() -> Obj | None:
        p = api.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
        st = p["status"]["containerStatuses"][0]
        if st["restartCount"] >= 1 and st["ready"] and condition(p, "Ready") == "True":
            return p
        return None

    pod = eventually("container restarted", restarted)
    st = pod["status"]["containerStatuses"][0]
    assert st["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
    new_body = answer(pod)
    assert new_body["pid"] != pid and new_body["hostname"] == name

    # Deleting the pod stops its process; the ReplicaSet replaces the pod.
    pid = new_body["pid"]
    api.delete(f"/api/v1/namespaces/{namespace}/pods/{name}")
    eventually("process stopped", lambda: None if pid_alive(pid) else True, timeout_s=30)
    eventually(
        "pod object removed", lambda: gone(api, f"/api/v1/namespaces/{namespace}/pods/{name}")
    )
    replacement = eventually("replacement pod Ready", lambda: ready_pod(api, namespace, {name}))
    assert answer(replacement)["hostname"] == replacement["metadata"]["name"]


def test_grace_period_then_sigkill(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    api = k8s_cluster.api
    pod: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "stubborn", "labels": {"app": "stubborn"}},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [web_container("--ignore-sigterm")],
        },
    }
    path = f"/api/v1/namespaces/{namespace}/pods/stubborn"
    api.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    eventually("pod Ready", lambda: condition(api.get(path), "Ready") == "True" or None)
    pid = process_node.pid(namespace, "stubborn")
    assert pid is not None

    started = time.monotonic()
    api.delete(path)
    eventually("pod object removed", lambda: gone(api, path), timeout_s=30)
    took = time.monotonic() - started
    assert not pid_alive(pid)
    # SIGTERM was ignored, so only the SIGKILL after the 2 s grace period ended it.
    assert took >= 2.0, took
    assert get_or_none(api, path) is None


def test_unicode_line_breaks_in_a_pod_do_not_deafen_the_node(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    """The API server writes U+0085 and U+2028 raw inside a watch event's JSON; a client
    that splits the stream at every Unicode line break (httpx's iter_lines) broke that
    event in two and failed every watch after it (the CRD fuzz test's pods did this)."""
    api = k8s_cluster.api
    odd = deployment("web")
    odd["spec"]["template"]["metadata"]["annotations"] = {"note": "next\x85line\u2028sep"}
    k8s_cluster.apply(odd, namespace)
    pod = eventually("the pod with line breaks runs", lambda: ready_pod(api, namespace))
    assert pod["metadata"]["annotations"]["note"] == "next\x85line\u2028sep"
    # And the node still hears about what comes after it.
    k8s_cluster.apply(deployment("web-later"), namespace)
    eventually(
        "the next pod runs",
        lambda: (
            [
                p
                for p in api.get(
                    f"/api/v1/namespaces/{namespace}/pods", labelSelector="app=web-later"
                )["items"]
                if p["status"].get("phase") == "Running"
            ]
            or None
        ),
    )
