"""The service-account credentials a kubelet mounts into a pod, for a local process.

A real pod finds its token under /var/run/secrets/kubernetes.io/serviceaccount and the API
server through KUBERNETES_SERVICE_HOST. A local process cannot see that mount, so the node
asks the API server for the same bound token (TokenRequest, bound to the pod) and writes a
kubeconfig that uses it; the container gets KUBECONFIG pointing at it. In-cluster loaders
(kopf, the kubernetes client) find no token file and fall back to that kubeconfig, so the
process talks to the API server as its ServiceAccount, under that account's RBAC.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..kubeapi import ApiError, Kube, Obj

# Long enough for any test run; a kubelet would refresh a shorter token instead.
TOKEN_SECONDS = 24 * 3600


def automount(api: Kube, pod: Obj) -> bool:
    """The pod's own setting wins, then its ServiceAccount's, then true (as in Kubernetes).
    A pod naming no ServiceAccount gets none: this control plane runs without the admission
    plugin that would fill in "default", and a token can only be bound to a pod for the
    account the pod names."""
    spec = pod["spec"]
    sa = spec.get("serviceAccountName")
    if not sa:
        return False
    if spec.get("automountServiceAccountToken") is not None:
        return bool(spec["automountServiceAccountToken"])
    ns = pod["metadata"]["namespace"]
    try:
        account = api.get(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}")
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise
    return bool(account.get("automountServiceAccountToken", True))


def bound_token(api: Kube, pod: Obj, seconds: int, audience: str | None = None) -> str:
    """A token for the pod's ServiceAccount, bound to the pod: what the kubelet asks for, for
    its token mount and for a projected serviceAccountToken volume."""
    meta = pod["metadata"]
    sa = pod["spec"].get("serviceAccountName") or "default"
    spec: Obj = {
        "expirationSeconds": seconds,
        "boundObjectRef": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "uid": meta["uid"],
        },
    }
    if audience:
        spec["audiences"] = [audience]
    answer = api.create(
        f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    return str(answer["status"]["token"])


def write_kubeconfig(api: Kube, pod: Obj, dest: Path) -> Path:
    """Requests a token bound to `pod` and writes token, ca.crt, namespace and a kubeconfig
    using them under `dest`; returns the kubeconfig's path."""
    meta = pod["metadata"]
    ns, sa = meta["namespace"], pod["spec"]["serviceAccountName"]
    token = bound_token(api, pod, TOKEN_SECONDS)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "token").write_text(token)
    shutil.copyfile(api.creds.ca_file, dest / "ca.crt")
    (dest / "namespace").write_text(ns)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "in-cluster",
                "cluster": {
                    "server": api.creds.server,
                    "certificate-authority": str(dest / "ca.crt"),
                },
            }
        ],
        "users": [{"name": sa, "user": {"tokenFile": str(dest / "token")}}],
        "contexts": [{"name": "in-cluster", "context": {"cluster": "in-cluster", "user": sa}}],
        "current-context": "in-cluster",
    }
    path = dest / "kubeconfig"
    path.write_text(json.dumps(config, indent=1))
    return path
