"""The engine apply handler's use case (engine_objects.apply_objects) on the real API server,
with the operator's credentials, while another writer changes the same objects.

The controller-manager updates a Deployment's status at any time; a patch or a delete pinned
to the resourceVersion the operator looked at is then refused with 409. The use case must
look again at once: leaving it to the handler's retry waits out kopf's minute of backoff (a
router turned off stayed up that long). The competing writer here is real: a label written
through the API server between the operator's look and its write, once per object.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import kopf
import pytest

from polykv_operator import manifests
from polykv_operator.api import PolyKVEngineSpec
from polykv_operator.engine_objects import apply_objects
from polykv_operator.kube import PATHS, Kube, Ownership
from polykv_testenv import ControlPlane

from ..helpers import Obj, get_or_none
from .test_operator import apply, engine_manifest, get
from .test_pool_finalizer import as_operator

pytestmark = pytest.mark.k8s

BUMP = "test.polykv.io/bumped"


class Racing(Kube):
    """The operator's Kube, with a second writer that changes each object it is about to
    write or delete (once per object) after the operator looked at it."""

    def __init__(self, kube: Kube, cluster: ControlPlane, namespace: str) -> None:
        super().__init__(kube.http)
        self.cluster, self.namespace = cluster, namespace
        self.bumped: list[str] = []

    async def _bump(self, seen: Ownership) -> None:
        if not seen.exists or seen.what in self.bumped:
            return
        self.bumped.append(seen.what)
        await asyncio.to_thread(
            self.cluster.kubectl, "label", "--overwrite", "-n", self.namespace,
            f"{seen.kind.lower()}/{seen.name}", f"{BUMP}={len(self.bumped)}",
        )  # fmt: skip

    async def apply_owned(self, namespace: str, obj: Obj, seen: Ownership) -> str:
        await self._bump(seen)
        return await super().apply_owned(namespace, obj, seen)

    async def delete_owned(self, namespace: str, api_version: str, seen: Ownership) -> bool:
        await self._bump(seen)
        return await super().delete_owned(namespace, api_version, seen)


def engine_and_objects(cluster: ControlPlane, namespace: str) -> tuple[str, list[Obj], list[Obj]]:
    """A PolyKVEngine (no operator runs) and the objects the handler would write for it, with
    its router on: (uid, own, router)."""
    body = engine_manifest()
    body["spec"]["router"] = {"enabled": True}
    apply(cluster, namespace, body)
    engine = get(cluster, namespace, "polykvengines", "eng")
    spec = PolyKVEngineSpec.model_validate(engine["spec"])
    own = manifests.engine_objects("eng", spec, [], None)
    router = manifests.router_objects("eng", namespace, spec)
    kopf.adopt(own + router, owner=cast(kopf.Body, engine))
    return str(engine["metadata"]["uid"]), own, router


def path_of(namespace: str, api_version: str, kind: str, name: str) -> str:
    return f"{PATHS[(api_version, kind)].format(ns=namespace)}/{name}"


def test_writes_and_deletes_refused_with_409_are_made_again_at_once(
    k8s_cluster: ControlPlane, namespace: str, operator_kubeconfig: Path
) -> None:
    uid, own, router = engine_and_objects(k8s_cluster, namespace)

    def run(router_on: bool) -> list[str]:
        async def body(kube: Kube) -> list[str]:
            racing = Racing(kube, k8s_cluster, namespace)
            clash = await apply_objects(
                racing, namespace, "eng", uid, own, router if router_on else None
            )
            assert clash is None
            return racing.bumped

        bumped: list[str] = as_operator(k8s_cluster, operator_kubeconfig, body)
        return bumped

    assert run(router_on=True) == []  # all created: nothing there to race on
    # Patched: each object changed under the operator once; every patch lands all the same.
    assert len(run(router_on=True)) == len(own) + len(router)
    dep = k8s_cluster.api.get(path_of(namespace, "apps/v1", "Deployment", "eng"))
    assert dep["metadata"]["labels"][BUMP]  # the other writer's label stays beside ours
    assert dep["metadata"]["ownerReferences"][0]["uid"] == uid
    # Router off: its objects are deleted, each after it changed under the operator.
    assert len(run(router_on=False)) == len(own) + len(router)
    for api_version, kind, name in manifests.router_kinds("eng"):
        assert get_or_none(k8s_cluster.api, path_of(namespace, api_version, kind, name)) is None
    assert get_or_none(k8s_cluster.api, path_of(namespace, "v1", "Service", "eng")) is not None
