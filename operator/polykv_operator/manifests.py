"""The objects a PolyKVEngine owns, as pure builders returning plain dicts.

The handler adds ownerReferences (kopf.adopt) and creates or patches them. The pods run
under the restricted Pod Security profile: non-root, no privilege escalation, no
capabilities, read-only root filesystem, RuntimeDefault seccomp.
"""

from __future__ import annotations

import hashlib
import hmac
import posixpath
from typing import Any

from .api import PolyKVEngineSpec
from .names import CONTAINER, ENGINE_LABEL, GATE

ADMIN_KEY_ENV = "POLYKV_ADMIN_KEY"
API_KEY_ENV = "LLAMA_API_KEY"  # the engine reads both keys from its environment
ADMIN_SECRET_KEY = "admin-key"
RUN_AS = 65532  # the conventional "nonroot" uid

Obj = dict[str, Any]


def labels(engine: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "polykv-engine",
        "app.kubernetes.io/instance": engine,
        "app.kubernetes.io/managed-by": "polykv-operator",
        ENGINE_LABEL: engine,
    }


def selector(engine: str) -> dict[str, str]:
    return {ENGINE_LABEL: engine}


def selector_string(engine: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(engine).items())


def admin_secret_name(engine: str) -> str:
    return f"{engine}-polykv-admin"


def admin_key(master: str, namespace: str, engine: str, uid: str) -> str:
    """The engine's admin key, derived rather than stored: the operator can recompute it
    after a restart without reading Secrets (its RBAC may only create and patch them)."""
    msg = f"{namespace}/{engine}/{uid}".encode()
    return hmac.new(master.encode(), msg, hashlib.sha256).hexdigest()


def admin_secret(engine: str, key: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": admin_secret_name(engine), "labels": labels(engine)},
        "type": "Opaque",
        "stringData": {ADMIN_SECRET_KEY: key},
    }


def engine_args(spec: PolyKVEngineSpec) -> list[str]:
    """polykv-engine's command line (llama-server flags plus the PolyKV ones)."""
    args = [
        "-m", spec.model.path,
        "-c", str(spec.context_size),
        "-np", str(spec.parallel),
        "--polykv-max-pools", str(spec.max_pools),
        "--host", "0.0.0.0",
        "--port", str(spec.port),
        "--metrics",
        "--log-format", "json",
        # The keys come from the container's env (Secrets), never argv: argv shows in ps.
    ]  # fmt: skip
    if spec.threads is not None:
        args += ["-t", str(spec.threads)]
    return args + list(spec.extra_args or [])


def _security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _model_volume(spec: PolyKVEngineSpec) -> tuple[Obj, Obj]:
    mount = spec.model.mount_path or posixpath.dirname(spec.model.path) or "/models"
    source = spec.model.volume or {"emptyDir": {}}
    volume = {"name": "model", **source}
    return volume, {"name": "model", "mountPath": mount, "readOnly": True}


def deployment(name: str, spec: PolyKVEngineSpec) -> Obj:
    volume, mount = _model_volume(spec)
    env: list[Obj] = [
        {
            "name": ADMIN_KEY_ENV,
            "valueFrom": {
                "secretKeyRef": {"name": admin_secret_name(name), "key": ADMIN_SECRET_KEY}
            },
        }
    ]
    if spec.api_key_secret_ref is not None:
        ref = spec.api_key_secret_ref
        env.append(
            {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    container: Obj = {
        "name": CONTAINER,
        "image": spec.image,
        "args": engine_args(spec),
        "env": env,
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        # /health is 503 while the model loads: startup covers loading, readiness the rest.
        "startupProbe": {**probe, "periodSeconds": 1, "failureThreshold": 600},
        "readinessProbe": {**probe, "periodSeconds": 1, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [mount],
        "securityContext": _security(),
    }
    if spec.resources:
        container["resources"] = spec.resources
    pod_spec: Obj = {
        # The operator sets this condition once the replica holds every declared pool.
        "readinessGates": [{"conditionType": GATE}],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": [volume],
    }
    if spec.model.init is not None:
        init = spec.model.init
        pod_spec["initContainers"] = [
            {
                "name": "model",
                "image": init.image or spec.image,
                "command": list(init.command),
                "volumeMounts": [{**mount, "readOnly": False}],
                "securityContext": _security(),
            }
        ]
    pod_labels = {**(spec.pod_labels or {}), **labels(name)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector(name)},
            # A new replica takes traffic only once its pools are in (readiness gate), so a
            # rolling update never drops the fleet below its size.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def service(name: str, spec: PolyKVEngineSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "selector": selector(name),
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http"}],
        },
    }
