"""Small waits and manifests shared by the smoke tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from polykv_testenv import ApiError, ControlPlane, Kube
from polykv_testenv.waiting import wait_for

T = TypeVar("T")
Obj = dict[str, Any]

GROUP = "smoke.polykv.io"
WIDGETS = f"/apis/{GROUP}/v1/namespaces/{{ns}}/widgets"


def eventually(what: str, probe: Callable[[], T | None], timeout_s: float = 60) -> T:
    return wait_for(what, probe, timeout_s, interval_s=0.2)


def kubeconfig_for(cluster: ControlPlane, token: str, path: Path) -> Path:
    """A kubeconfig at `path` that logs in to `cluster` with a bearer token."""
    creds = cluster.credentials
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": creds.server, "certificate-authority": str(creds.ca_file)},
            }
        ],
        "users": [{"name": "token", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "token"}}],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def get_or_none(api: Kube, path: str) -> Obj | None:
    try:
        return api.get(path)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def fetch_if(api: Kube, path: str, pred: Callable[[Obj], object]) -> Obj | None:
    """The object at `path` when `pred` holds for it (a probe for `eventually`)."""
    obj = get_or_none(api, path)
    return obj if obj is not None and pred(obj) else None


def is_ready(obj: Obj) -> bool:
    return condition(obj, "Ready") == "True"


def gone(api: Kube, path: str) -> bool | None:
    return True if get_or_none(api, path) is None else None


def condition(obj: Obj, ctype: str) -> str | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return str(c["status"])
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def widget_crd() -> Obj:
    """A CRD with a status subresource and CEL rules (one of them a transition rule)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["mode", "size"],
                                    "properties": {
                                        "mode": {"type": "string"},
                                        "size": {"type": "integer", "minimum": 1},
                                    },
                                    "x-kubernetes-validations": [
                                        {"rule": "self.size <= 10", "message": "size above 10"},
                                        {
                                            "rule": "self.mode == oldSelf.mode",
                                            "message": "mode is immutable",
                                        },
                                    ],
                                },
                                "status": {
                                    "type": "object",
                                    "properties": {
                                        "phase": {"type": "string"},
                                        "observedSize": {"type": "integer"},
                                    },
                                },
                            },
                        }
                    },
                }
            ],
        },
    }


def install_widget_crd(cluster: ControlPlane) -> None:
    cluster.apply(widget_crd())
    cluster.kubectl("wait", "--for=condition=Established", f"crd/widgets.{GROUP}", "--timeout=60s")


def web_container(*args: str, probe_period: int = 1) -> Obj:
    return {
        "name": "web",
        "image": "polykv/testserver:1",
        "args": ["--port", "8080", *args],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": probe_period,
        },
    }
