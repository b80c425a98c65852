"""A small async Kubernetes client for the writes kopf does not do for us (owned objects,
pod readiness gates and deletion costs, deleting child pools and a disabled router, the
status the engine loops write), on the credentials kopf logged in with.

Owned objects are written only after `ownership` found them absent or ours: an object of
the same name that the engine does not control is never patched or deleted.
"""

from __future__ import annotations

import base64
import logging
import ssl
import tempfile
from dataclasses import dataclass
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
JSON_PATCH = "application/json-patch+json"

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
    ("networking.k8s.io/v1", "NetworkPolicy"): (
        "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
    ),
}
OURS = "/apis/polykv.io/v1alpha1/namespaces/{ns}/{plural}"
POOLS = OURS.replace("{plural}", "polykvpools")


@dataclass(frozen=True)
class Ownership:
    """What the API server holds under a name the operator wants: nothing, an object of
    ours (its uid and resourceVersion), or somebody else's (`ours` False)."""

    kind: str
    name: str
    exists: bool
    uid: str | None = None  # set only when the object is ours
    version: str | None = None

    @property
    def ours(self) -> bool:
        return self.uid is not None

    @property
    def what(self) -> str:
        return f"{self.kind} {self.name}"


class KubeError(Exception):
    def __init__(self, status: int, text: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {text[:500]}")
        self.status = status


def retain_volume_keys(obj: Obj) -> Obj:
    """``obj`` with ``$retainKeys`` on each volume of its pod template. A strategic merge
    patch merges volumes by name, field by field: a volume whose source changed (a claim
    to an emptyDir) would keep its old source beside the new one, which the API server
    refuses; the directive drops every field the volume no longer names."""
    template = (obj.get("spec") or {}).get("template") or {}
    pod = template.get("spec") or {}
    if not pod.get("volumes"):
        return obj
    volumes = [{**v, "$retainKeys": sorted(v)} for v in pod["volumes"]]
    template = {**template, "spec": {**pod, "volumes": volumes}}
    return {**obj, "spec": {**obj["spec"], "template": template}}


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
        self,
        method: str,
        path: str,
        body: Obj | list[Obj] | None = None,
        ctype: str = "application/json",
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

    async def ownership(
        self, namespace: str, api_version: str, kind: str, name: str, owner_uid: str
    ) -> Ownership:
        """Whether the object exists and whose it is, read without the `get` verb: a JSON
        patch made only of `test` ops changes nothing, and the API server applies it only
        when the object's first ownerReference is `owner_uid`'s controller reference
        (objects the operator creates carry exactly that one). A failed test is a 422 and
        returns nothing of the object, so a foreign Secret is never read."""
        path = f"{PATHS[(api_version, kind)].format(ns=namespace)}/{name}"
        tests: list[Obj] = [
            {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": owner_uid},
            {"op": "test", "path": "/metadata/ownerReferences/0/controller", "value": True},
        ]
        try:
            resp = await self._req("PATCH", path, tests, JSON_PATCH)
        except KubeError as exc:
            if exc.status == 404:
                return Ownership(kind, name, exists=False)
            if exc.status == 422:
                return Ownership(kind, name, exists=True)
            raise
        meta = resp.json()["metadata"]
        return Ownership(kind, name, True, str(meta["uid"]), str(meta["resourceVersion"]))

    async def apply_owned(self, namespace: str, obj: Obj, seen: Ownership) -> str:
        """Creates the object (`seen` says it is absent) or patches the one `seen` found ours,
        at the resourceVersion it was found at: a 409 (it changed, or appeared, meanwhile)
        raises, and the caller looks again. Returns what happened."""
        base = PATHS[(obj["apiVersion"], obj["kind"])].format(ns=namespace)
        if not seen.exists:
            await self._req("POST", base, obj)
            return "created"
        if not seen.ours:
            raise ValueError(f"{seen.what} is not ours to patch")
        pinned = {**obj, "metadata": {**obj["metadata"], "resourceVersion": seen.version}}
        # Secrets are merge-patched (no strategic keys to merge in them), the rest strategic.
        if obj["kind"] == "Secret":
            await self._req("PATCH", f"{base}/{seen.name}", pinned, MERGE)
        else:
            await self._req("PATCH", f"{base}/{seen.name}", retain_volume_keys(pinned), STRATEGIC)
        return "patched"

    async def delete_owned(self, namespace: str, api_version: str, seen: Ownership) -> bool:
        """Deletes the object `seen` found ours, on the condition that it is still that
        object (uid and resourceVersion preconditions). False when it is gone already."""
        if not seen.ours:
            raise ValueError(f"{seen.what} is not ours to delete")
        path = f"{PATHS[(api_version, seen.kind)].format(ns=namespace)}/{seen.name}"
        body = {
            "propagationPolicy": "Background",
            "preconditions": {"uid": seen.uid, "resourceVersion": seen.version},
        }
        try:
            await self._req("DELETE", path, body)
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

    async def set_ca_bundle(self, apiservice: str, ca_bundle: str) -> None:
        """The caBundle of our APIService (its other fields are the chart's; the admission
        policy lets this write change nothing else)."""
        path = f"/apis/apiregistration.k8s.io/v1/apiservices/{apiservice}"
        await self._req("PATCH", path, {"spec": {"caBundle": ca_bundle}}, MERGE)

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
