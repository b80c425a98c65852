"""The engine image runs as the real `polykv-engine` process, its model on a volume."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from polykv_testenv import ControlPlane, ProcessNode

from ..helpers import Obj, eventually, fetch_if, is_ready

pytestmark = pytest.mark.k8s


def test_engine_image_serves_from_a_volume(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str, test_model: Path
) -> None:
    api = k8s_cluster.api
    pod: Obj = {
        "metadata": {"name": "engine"},
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "polykv/engine:dev",
                    # --host is forced to the pod IP; the model path is inside the volume.
                    "args": [
                        "--host",
                        "0.0.0.0",
                        "--port",
                        "8080",
                        "-m",
                        f"/models/{test_model.name}",
                    ],
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "readinessProbe": {
                        "httpGet": {"path": "/health", "port": "http"},
                        "periodSeconds": 1,
                    },
                    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
                }
            ],
            "volumes": [{"name": "models", "hostPath": {"path": str(test_model.parent)}}],
        },
    }
    path = f"/api/v1/namespaces/{namespace}/pods/engine"
    api.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    got = eventually("engine Ready", lambda: fetch_if(api, path, is_ready), timeout_s=120)
    ip = got["status"]["podIP"]
    r = httpx.get(f"http://{ip}:8080/health", timeout=5)
    assert r.status_code == 200
    assert process_node.pid(namespace, "engine") is not None
