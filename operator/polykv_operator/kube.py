"""A small async Kubernetes client for the writes kopf does not do for us (owned objects,
pod readiness gates and deletion costs, deleting child pools and a disabled router, the
status the engine loops write), on the credentials kopf logged in with.
"""

from __future__ import annotations

import base64
import logging
import ssl
import tempfile
from pathlib import Path
from typing import Any

import httpx

from .conditions import now_rfc3339
from .gates import GateWant
from .names import DELETION_COST, GATE

log = logging.getLogger("polykv.operator.kube")

Obj = dict[str, Any]
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"

# Where each kind lives in the REST API (only the kinds the operator writes).
PATHS = {
    ("v1", "Secret"): "/api/v1/namespaces/{ns}/secrets",
    ("v1", "Service"): "/api/v1/namespaces/{ns}/services",
    ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{ns}/deployments",
    ("v1", "ServiceAccount"): "/api/v1/namespaces/{ns}/serviceaccounts",
    (
        "rbac.authorization.k8s.io/v1",
        "Role",
    ): "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): (
        "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"
    ),
}
OURS = "/apis/polykv.io/v1alpha1/namespaces/{ns}/{plural}"
POOLS = OURS.replace("{plural}", "polykvpools")


class KubeError(Exception):
    def __init__(self, status: int, text: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {text[:500]}")
        self.status = status


class Kube:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    @classmethod
    def from_connection(cls, info: Any) -> Kube:
        """From a kopf.ConnectionInfo (as a login handler returns it)."""
        return cls(httpx.AsyncClient(base_url=info.server, **_tls_and_auth(info), timeout=30))

    async def close(self) -> None:
        await self.http.aclose()

    async def _req(
        self, method: str, path: str, body: Obj | None = None, ctype: str = "application/json"
    ) -> httpx.Response:
        headers = {"Content-Type": ctype} if body is not None else {}
        resp = await self.http.request(method, path, json=body, headers=headers)
        if resp.status_code >= 400:
            raise KubeError(resp.status_code, resp.text, f"{method} {path}")
        return resp

    async def get(self, path: str) -> Obj | None:
        """A read (the autoscaling servers' few); None when the object is not there."""
        try:
            resp = await self._req("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        out: Obj = resp.json()
        return out

    async def apply(self, namespace: str, obj: Obj, strategic: bool = True) -> str:
        """Create the object, or patch it to match when it exists. Returns what happened."""
        base = PATHS[(obj["apiVersion"], obj["kind"])].format(ns=namespace)
        name = obj["metadata"]["name"]
        try:
            await self._req("POST", base, obj)
            return "created"
        except KubeError as exc:
            if exc.status != 409:
                raise
        await self._req("PATCH", f"{base}/{name}", obj, STRATEGIC if strategic else MERGE)
        return "patched"

    async def delete(self, namespace: str, api_version: str, kind: str, name: str) -> bool:
        """Deletes an object the operator owns; False when it was not there."""
        path = f"{PATHS[(api_version, kind)].format(ns=namespace)}/{name}"
        try:
            await self._req("DELETE", path, {"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status != 404:
                raise
            return False
        return True

    async def set_gate(self, namespace: str, pod: str, want: GateWant) -> None:
        cond = {
            "type": GATE,
            "status": "True" if want.status else "False",
            "reason": want.reason,
            "message": want.message,
            "lastTransitionTime": now_rfc3339(),
        }
        # Strategic merge keys conditions by type: the kubelet's own conditions stay.
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}/status"
        try:
            await self._req("PATCH", path, {"status": {"conditions": [cond]}}, STRATEGIC)
        except KubeError as exc:
            if exc.status != 404:  # the pod went away meanwhile
                raise

    async def set_deletion_cost(self, namespace: str, pod: str, cost: str) -> None:
        """The pod's pod-deletion-cost annotation (a ReplicaSet deletes the lowest first)."""
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}"
        body = {"metadata": {"annotations": {DELETION_COST: cost}}}
        try:
            await self._req("PATCH", path, body, MERGE)
        except KubeError as exc:
            if exc.status != 404:  # the pod went away meanwhile
                raise

    async def patch_status(self, namespace: str, plural: str, name: str, patch: Obj) -> None:
        """Merge-patch the status of one of our objects; one that is gone is not an error."""
        path = f"{OURS.format(ns=namespace, plural=plural)}/{name}/status"
        try:
            await self._req("PATCH", path, {"status": patch}, MERGE)
        except KubeError as exc:
            if exc.status != 404:
                raise

    async def delete_pool(self, namespace: str, name: str) -> None:
        try:
            await self._req(
                "DELETE",
                f"{POOLS.format(ns=namespace)}/{name}",
                {"propagationPolicy": "Background"},
            )
        except KubeError as exc:
            if exc.status != 404:
                raise


def _tls_and_auth(info: Any) -> dict[str, Any]:
    ctx = ssl.create_default_context()
    if info.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif info.ca_path:
        ctx.load_verify_locations(cafile=str(info.ca_path))
    elif info.ca_data:
        ctx.load_verify_locations(cadata=_pem(info.ca_data))
    cert = info.certificate_path or _spill(info.certificate_data)
    key = info.private_key_path or _spill(info.private_key_data)
    if cert and key:
        ctx.load_cert_chain(str(cert), str(key))
    headers = {}
    if info.token:
        headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
    auth = (info.username, info.password) if info.username and info.password else None
    return {"verify": ctx, "headers": headers, "auth": auth}


def _pem(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    if b"-----BEGIN" not in raw:
        raw = base64.b64decode(raw)
    return raw.decode()


def _spill(data: str | bytes | None) -> Path | None:
    """ssl wants certificate files; kubeconfigs may inline them."""
    if not data:
        return None
    f = tempfile.NamedTemporaryFile("w", suffix=".pem", delete=False)  # noqa: SIM115
    with f:
        f.write(_pem(data))
    return Path(f.name)
