"""Use case of the engine's apply handler: write the objects a PolyKVEngine owns, and take
a turned-off router's objects away, touching nothing the engine does not control.

Every name is looked up first (`Kube.ownership`). When any of them is held by an object the
engine is not the controller of (another team's `api-router`, a Service named after the
engine), nothing at all is written: the engine turns `Stalled` with a message naming each
such object, and the handler retries later (the clash may be resolved by deleting or
renaming either side). Objects found ours are patched at the resourceVersion they were seen
at; a router that is off has only its objects that are ours deleted, and so has the
router RoleBinding of an older layout (manifests.legacy_router_binding).

A write or delete refused with 409 (the controller-manager updated a Deployment's status
between our look and our write, or an object appeared) looks at that object again and tries
again at once, a few times: leaving it to the handler's retry waits out kopf's minute of
backoff.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import manifests
from .faults import crash_point
from .kube import Kube, KubeError, Obj, Ownership

log = logging.getLogger("polykv.operator.objects")

# The engine's own objects have crash points (faults.POINTS); a router's do not.
CRASH_AFTER = {
    "Secret": "secret-applied",
    "Deployment": "deployment-applied",
    "Service": "service-applied",
}


CONFLICT_TRIES = 5  # writes of one object refused with 409 before the handler's retry takes over


class OwnerChanged(Exception):
    """An object we were writing is no longer ours: the handler's next round finds the clash."""


@dataclass(frozen=True)
class Clash:
    """Names the engine wants that other objects hold."""

    foreign: tuple[Ownership, ...]

    @property
    def message(self) -> str:
        names = ", ".join(o.what for o in self.foreign)
        return (
            f"name clash: held by objects this PolyKVEngine does not control: {names}; "
            "nothing is written until they are removed or the engine is renamed"
        )


async def apply_objects(
    kube: Kube,
    namespace: str,
    engine: str,
    owner_uid: str,
    own: list[Obj],
    router: list[Obj] | None,
) -> Clash | None:
    """Writes `own` (and `router`, when the router is on) or, with the router off, deletes
    the router objects that are ours. Returns the clash when a name is held by someone else,
    having written nothing."""
    wanted = own + (router or [])
    seen = [
        await kube.ownership(
            namespace, o["apiVersion"], o["kind"], o["metadata"]["name"], owner_uid
        )
        for o in wanted
    ]
    foreign = tuple(s for s in seen if s.exists and not s.ours)
    if foreign:
        return Clash(foreign)
    for i, (obj, found) in enumerate(zip(wanted, seen, strict=True)):
        what = await _write(kube, namespace, owner_uid, obj, found)
        log.info("%s %s/%s %s", obj["kind"], namespace, found.name, what)
        point = CRASH_AFTER.get(obj["kind"]) if i < len(own) else None
        if point is not None:
            crash_point(point)
    gone = [] if router is not None else manifests.router_kinds(engine)
    for api_version, kind, name in [*gone, manifests.legacy_router_binding(engine)]:
        await _delete_if_ours(kube, namespace, owner_uid, api_version, kind, name)
    return None


def _conflict(exc: KubeError, attempt: int) -> bool:
    return exc.status == 409 and attempt < CONFLICT_TRIES


async def _write(kube: Kube, namespace: str, owner_uid: str, obj: Obj, seen: Ownership) -> str:
    """Creates or patches `obj`, looking again after each 409."""
    for attempt in range(1, CONFLICT_TRIES + 1):
        try:
            return await kube.apply_owned(namespace, obj, seen)
        except KubeError as exc:
            if not _conflict(exc, attempt):
                raise
        log.info("%s %s/%s changed meanwhile: looking again", seen.kind, namespace, seen.name)
        seen = await kube.ownership(namespace, obj["apiVersion"], seen.kind, seen.name, owner_uid)
        if seen.exists and not seen.ours:
            raise OwnerChanged(f"{seen.what} is no longer ours")
    raise AssertionError("unreachable")


async def _delete_if_ours(
    kube: Kube, namespace: str, owner_uid: str, api_version: str, kind: str, name: str
) -> None:
    """Deletes the object when it is ours, looking again after each 409."""
    for attempt in range(1, CONFLICT_TRIES + 1):
        found = await kube.ownership(namespace, api_version, kind, name, owner_uid)
        if found.exists and not found.ours:
            log.info("%s %s/%s is not ours: left alone", kind, namespace, name)
            return
        if not found.exists:
            return
        try:
            if await kube.delete_owned(namespace, api_version, found):
                log.info("%s %s/%s deleted (not wanted)", kind, namespace, name)
            return
        except KubeError as exc:
            if not _conflict(exc, attempt):
                raise
        log.info("%s %s/%s changed meanwhile: looking again", kind, namespace, name)
