"""An engine's replicas are the pods its own Deployment's ReplicaSets control, by uid; the
engine label alone (anyone may set it) makes no pod a replica."""

from __future__ import annotations

from typing import Any

from polykv_operator.fleet import ReplicaRef, controller_uid
from polykv_operator.replicas import owned_by

ENGINE = "uid-engine"
REPLICASETS = {"rs-ours": "dep-ours", "rs-theirs": "dep-theirs"}
DEPLOYMENTS = {"dep-ours": ENGINE, "dep-theirs": "uid-other-engine"}


def ref(kind: str, uid: str, controller: bool = True, api: str = "apps/v1") -> dict[str, Any]:
    return {"apiVersion": api, "kind": kind, "name": "web-x", "uid": uid, "controller": controller}


def pod(name: str, *refs: dict[str, Any]) -> ReplicaRef:
    meta = {"name": name, "uid": f"uid-{name}", "ownerReferences": list(refs)}
    return ReplicaRef.from_pod({"metadata": meta, "status": {}})


def test_only_the_chain_to_the_engine_makes_a_replica() -> None:
    pods = [
        pod("ours", ref("ReplicaSet", "rs-ours")),
        pod("bare"),  # the label and nothing else
        pod("other-engine", ref("ReplicaSet", "rs-theirs")),
        pod("unknown-rs", ref("ReplicaSet", "rs-not-indexed")),
        pod("not-controller", ref("ReplicaSet", "rs-ours", controller=False)),
        pod("statefulset", ref("StatefulSet", "rs-ours")),
        pod("wrong-group", ref("ReplicaSet", "rs-ours", api="example.com/v1")),
    ]
    mine = owned_by(pods, ENGINE, REPLICASETS.get, DEPLOYMENTS.get)
    assert [p.name for p in mine] == ["ours"]


def test_the_controller_is_the_only_owner_that_counts() -> None:
    meta = {"ownerReferences": [ref("ReplicaSet", "a", controller=False), ref("Deployment", "b")]}
    assert controller_uid(meta, "Deployment", "apps/v1") == "b"
    assert controller_uid(meta, "ReplicaSet", "apps/v1") is None
    assert controller_uid({}, "Deployment", "apps/v1") is None
