"""The objects a PolyKVEngine owns, as pure builders returning plain dicts.

The handler adds ownerReferences (kopf.adopt) and creates or patches them. The pods run
under the restricted Pod Security profile: non-root, no privilege escalation, no
capabilities, read-only root filesystem, RuntimeDefault seccomp.

With ``spec.router.enabled`` an engine also owns a polykv-router: its ServiceAccount, a
RoleBinding of the shared router ClusterRole (list and watch pods) in its namespace, a
Deployment and a Service. The router's flags and environment are its command-line contract
(``polykv_router.config``); a test parses what these builders write with it.
"""

from __future__ import annotations

import hashlib
import hmac
import posixpath
from typing import Any

from .api import PolyKVEngineSpec, RouterSpec
from .names import CONTAINER, ENGINE_LABEL, GATE, ROUTER_CONTAINER, ROUTER_LABEL
from .network_policies import NetworkPolicyConfig, engine_policy, router_policy

ADMIN_KEY_ENV = "POLYKV_ADMIN_KEY"
API_KEY_ENV = "LLAMA_API_KEY"  # the engine reads both keys from its environment
ADMIN_SECRET_KEY = "admin-key"
ROUTER_KEY_ENV = "POLYKV_ROUTER_KEY"  # engine and router both read it (their own flags)
ROUTER_SECRET_KEY = "router-key"
API_SECRET_KEY = "api-key"
RUN_AS = 65532  # the conventional "nonroot" uid
# The router's environment (polykv_router.config reads these names).
ROUTER_API_KEY_ENV = "POLYKV_ROUTER_ENGINE_API_KEY"
ROUTER_SA_DIR_ENV = "POLYKV_ROUTER_SERVICEACCOUNT_DIR"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_SECONDS = 3607  # what the ServiceAccount admission plugin asks for; the kubelet rotates
SNAPSHOT_DIR = "/var/lib/polykv/snapshots"

Obj = dict[str, Any]


def _labels(app: str, engine: str, own: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": app,
        "app.kubernetes.io/instance": engine,
        "app.kubernetes.io/managed-by": "polykv-operator",
        own: engine,
    }


def labels(engine: str) -> dict[str, str]:
    return _labels("polykv-engine", engine, ENGINE_LABEL)


def selector(engine: str) -> dict[str, str]:
    return {ENGINE_LABEL: engine}


def selector_string(engine: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(engine).items())


def admin_secret_name(engine: str) -> str:
    return f"{engine}-polykv-admin"


def api_key_secret_name(engine: str) -> str:
    return f"{engine}-polykv-api-key"


def admin_key(master: str, namespace: str, engine: str, uid: str) -> str:
    """The engine's admin key, derived rather than stored: the operator can recompute it
    after a restart without reading Secrets (its RBAC may only create and patch them)."""
    msg = f"{namespace}/{engine}/{uid}".encode()
    return hmac.new(master.encode(), msg, hashlib.sha256).hexdigest()


def derived_key(master: str, purpose: str, namespace: str, engine: str, uid: str) -> str:
    """Another key of the engine's, derived like the admin key but for `purpose` ("api":
    the generated inference key, "router": the router's identity): none equals another."""
    msg = f"{purpose}:{namespace}/{engine}/{uid}".encode()
    return hmac.new(master.encode(), msg, hashlib.sha256).hexdigest()


def admin_secret(engine: str, key: str, router_key: str) -> Obj:
    """The admin key, and the router key that the engine and its router share (the engine
    honours a router's re-homed marker and overcommit only from it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": admin_secret_name(engine), "labels": labels(engine)},
        "type": "Opaque",
        "stringData": {ADMIN_SECRET_KEY: key, ROUTER_SECRET_KEY: router_key},
    }


def api_key_secret(engine: str, key: str) -> Obj:
    """The inference key the operator generates when the spec names none
    (``apiKeySecretRef``): an engine never serves without one. Agents are given this
    Secret (its name is fixed: ``<engine>-polykv-api-key``), never the admin one."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": api_key_secret_name(engine), "labels": labels(engine)},
        "type": "Opaque",
        "stringData": {API_SECRET_KEY: key},
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
    if spec.snapshots.enabled:
        args += [
            "--polykv-snapshot-dir", SNAPSHOT_DIR,
            "--polykv-snapshot-mib", str(spec.snapshots.size_mib),
            "--polykv-session-save-mib", str(spec.snapshots.sessions_mib),
        ]  # fmt: skip
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


def _snapshot_volume(spec: PolyKVEngineSpec) -> tuple[Obj, Obj]:
    snaps = spec.snapshots
    # An emptyDir past its sizeLimit gets the pod evicted: twice the store's bound leaves
    # room for a file on its way in (the store counts it once whole).
    source = snaps.volume or {"emptyDir": {"sizeLimit": f"{2 * snaps.size_mib}Mi"}}
    return {"name": "snapshots", **source}, {"name": "snapshots", "mountPath": SNAPSHOT_DIR}


def _api_key_env(engine: str, spec: PolyKVEngineSpec, var: str) -> list[Obj]:
    """The inference key: the spec's Secret, else the one the operator generates."""
    ref = spec.api_key_secret_ref
    name, key = (ref.name, ref.key) if ref else (api_key_secret_name(engine), API_SECRET_KEY)
    return [{"name": var, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}]


def _router_key_env(engine: str) -> Obj:
    ref = {"name": admin_secret_name(engine), "key": ROUTER_SECRET_KEY}
    return {"name": ROUTER_KEY_ENV, "valueFrom": {"secretKeyRef": ref}}


def _pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def deployment(name: str, spec: PolyKVEngineSpec) -> Obj:
    volume, mount = _model_volume(spec)
    env: list[Obj] = [
        {
            "name": ADMIN_KEY_ENV,
            "valueFrom": {
                "secretKeyRef": {"name": admin_secret_name(name), "key": ADMIN_SECRET_KEY}
            },
        },
        *_api_key_env(name, spec, API_KEY_ENV),
        _router_key_env(name),
    ]
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
    volumes = [volume]
    if spec.snapshots.enabled:
        snap_volume, snap_mount = _snapshot_volume(spec)
        volumes.append(snap_volume)
        container["volumeMounts"].append(snap_mount)
    pod_spec: Obj = {
        # The operator sets this condition once the replica holds every declared pool.
        "readinessGates": [{"conditionType": GATE}],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": volumes,
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


# ---------------------------------------------------------------------------- the router


def router_name(engine: str) -> str:
    return f"{engine}-router"


def router_labels(engine: str) -> dict[str, str]:
    return _labels("polykv-router", engine, ROUTER_LABEL)


def router_args(engine: str, spec: PolyKVEngineSpec, router: RouterSpec) -> list[str]:
    """polykv-router's command line: which pods are the engine's replicas, and its knobs."""
    return [
        "--host", "0.0.0.0",
        "--port", str(router.port),
        "--selector", selector_string(engine),
        "--engine-port", str(spec.port),
        "--session-ttl-s", str(router.session_ttl_seconds),
        "--poll-interval-ms", str(router.poll_interval_ms),
        "--log-format", "json",
    ]  # fmt: skip


def router_service_account(engine: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": router_name(engine), "labels": router_labels(engine)},
        # The pod mounts its own short-lived, rotated token (router_deployment).
        "automountServiceAccountToken": False,
    }


ROUTER_CLUSTER_ROLE = "polykv-router"
"""The ClusterRole the chart (and deploy/rbac.yaml) installs for every router: list and
watch pods. The operator binds it per router and never writes a Role: it needs no verb on
roles, and a RoleBinding to a role whose rules it holds itself needs no `bind`."""


def router_role_binding(
    engine: str, namespace: str, cluster_role: str = ROUTER_CLUSTER_ROLE
) -> Obj:
    """All the router may do: see the pods of its own namespace (their address, readiness
    and deletion), through the shared ClusterRole bound in this namespace only; it writes
    nothing and reads no Secret."""
    account = router_name(engine)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": router_binding_name(engine), "labels": router_labels(engine)},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": cluster_role,
        },
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
    }


def router_binding_name(engine: str) -> str:
    """Not the router's own name: earlier operators bound a Role of their own under that
    name, and a RoleBinding's roleRef cannot change (legacy_router_binding)."""
    return f"{router_name(engine)}{ROUTER_BINDING_SUFFIX}"


ROUTER_BINDING_SUFFIX = "-pod-reader"  # files/operator-admission.yaml checks it


def _token_volume() -> Obj:
    """What the ServiceAccount admission plugin would mount, declared explicitly: a bound,
    expiring token, the cluster CA and the namespace."""
    return {
        "name": "kube-api-access",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_SECONDS}},
                {
                    "configMap": {
                        "name": "kube-root-ca.crt",
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    }
                },
                {
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "namespace",
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                            }
                        ]
                    }
                },
            ]
        },
    }


def router_deployment(engine: str, spec: PolyKVEngineSpec) -> Obj:
    router = spec.router or RouterSpec()
    name = router_name(engine)
    # The router's own reads (capacity, boot id, where a session is) are read-only routes:
    # they need the API key. The router never holds the admin key; its router key only
    # marks what it forwards as the router's. Clients' requests carry their own key.
    env: list[Obj] = [
        # Stated although it is the default: a runtime that rewrites mount paths (the local
        # process node) finds the directory through it.
        {"name": ROUTER_SA_DIR_ENV, "value": SA_DIR},
        *_api_key_env(engine, spec, ROUTER_API_KEY_ENV),
        _router_key_env(engine),
    ]
    container: Obj = {
        "name": ROUTER_CONTAINER,
        "image": router.image,
        "args": router_args(engine, spec, router),
        "env": env,
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "volumeMounts": [{"name": "kube-api-access", "mountPath": SA_DIR, "readOnly": True}],
        "securityContext": _security(),
    }
    if router.resources:
        container["resources"] = router.resources
    labels = router_labels(engine)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": {ROUTER_LABEL: engine}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": name,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": _pod_security(),
                    # Streams in flight finish within the router's own shutdown timeout (25 s).
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container],
                    "volumes": [_token_volume()],
                },
            },
        },
    }


def router_service(engine: str, spec: PolyKVEngineSpec) -> Obj:
    router = spec.router or RouterSpec()
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": router_name(engine), "labels": router_labels(engine)},
        "spec": {
            "selector": {ROUTER_LABEL: engine},
            "ports": [{"name": "http", "port": router.port, "targetPort": "http"}],
        },
    }


def router_objects(
    engine: str,
    namespace: str,
    spec: PolyKVEngineSpec,
    cluster_role: str = ROUTER_CLUSTER_ROLE,
    policy: NetworkPolicyConfig | None = None,
) -> list[Obj]:
    """Everything a router needs, in the order to create it (the account and the
    NetworkPolicy before its pods)."""
    name = router_name(engine)
    fence = [router_policy(name, engine, spec, router_labels(engine), policy)] if policy else []
    return [
        router_service_account(engine),
        router_role_binding(engine, namespace, cluster_role),
        *fence,
        router_deployment(engine, spec),
        router_service(engine, spec),
    ]


def engine_objects(
    name: str, spec: PolyKVEngineSpec, secrets: list[Obj], policy: NetworkPolicyConfig | None
) -> list[Obj]:
    """The engine's own objects, in the order to create them: its Secrets and NetworkPolicy
    before its pods."""
    fence = [engine_policy(name, spec, labels(name), policy)] if policy else []
    return [*secrets, *fence, deployment(name, spec), service(name, spec)]


def router_kinds(engine: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of what router_objects makes, in the order to delete it
    (the pods before their account and their NetworkPolicy)."""
    name = router_name(engine)
    return [
        ("apps/v1", "Deployment", name),
        ("networking.k8s.io/v1", "NetworkPolicy", name),
        ("v1", "Service", name),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", router_binding_name(engine)),
        ("v1", "ServiceAccount", name),
    ]


def legacy_router_binding(engine: str) -> tuple[str, str, str]:
    """The RoleBinding an older operator made under the router's own name, to a Role of its
    own: taken away when found ours (its Role, which this operator may not delete, goes with
    the engine, through the garbage collector)."""
    return ("rbac.authorization.k8s.io/v1", "RoleBinding", router_name(engine))
