"""Which pods are an engine's own replicas: those whose owner chain, by uid, is pod ->
ReplicaSet -> Deployment -> the PolyKVEngine, each link a controller ownerReference.

Anyone who may create a pod may give it the engine's label. A pod that only carries the
label is never polled (the poll carries the engine's admin key), never released from, and
never gets the readiness gate or the deletion cost written. The chain is read from the
operator's indexes of the ReplicaSets and Deployments that carry the engine label; a pod
whose ReplicaSet is not indexed yet waits for a later round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .fleet import ReplicaRef

ControllerOf = Callable[[str], str | None]
"""uid of an object (ReplicaSet or Deployment) -> uid of its controller, if indexed."""


def owned_by(
    pods: Iterable[ReplicaRef],
    engine_uid: str,
    replicaset_owner: ControllerOf,
    deployment_owner: ControllerOf,
) -> list[ReplicaRef]:
    """The pods whose ReplicaSet's Deployment is controlled by the engine `engine_uid`."""

    def ours(pod: ReplicaRef) -> bool:
        rs = pod.replicaset
        deployment = replicaset_owner(rs) if rs else None
        return deployment is not None and deployment_owner(deployment) == engine_uid

    return [p for p in pods if ours(p)]
