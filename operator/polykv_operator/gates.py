"""The pod readiness gate (names.GATE), decided as a pure function.

A replica joins the Service only once its whole declared tree (and its admission policies)
is on it. A replica whose engine process restarted has lost its pools: its gate drops
before anything is re-materialized, and rises again only when the tree is back.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fleet import Observation, ReplicaRef, Synced, boot_message, boot_tag


@dataclass(frozen=True)
class GateWant:
    status: bool
    reason: str
    message: str


def _named_boot_is_current(pod: ReplicaRef, obs: Observation | None) -> bool | None:
    """Whether the boot a True gate's message names is the engine's boot now; None when
    either is unknown (no True gate, a gate without a boot, no listing)."""
    boot = obs.boot_id if obs is not None else None
    if pod.gate != "True" or pod.gate_boot is None or boot is None:
        return None
    return boot_tag(boot) == pod.gate_boot


def restarted(pod: ReplicaRef, obs: Observation | None, synced: Synced | None) -> bool:
    """The engine process is not the one whose gate was turned True: by us (`synced`), or,
    before we synced it, by an earlier operator run (the boot its gate message names)."""
    if synced is None:
        return _named_boot_is_current(pod, obs) is False
    if pod.restarts != synced.restarts:
        return True
    return obs is not None and obs.boot_id is not None and obs.boot_id != synced.boot_id


def in_service(pod: ReplicaRef, obs: Observation | None, synced: Synced | None) -> bool:
    """The gate is True for the engine process answering now. After an operator restart
    (nothing synced yet) the boot named in the gate's message vouches for it, so that a
    restarted operator repairs a serving replica in place instead of taking it out."""
    if synced is None:
        return _named_boot_is_current(pod, obs) is True
    return pod.gate == "True" and not restarted(pod, obs, synced)


def decide(
    pod: ReplicaRef, obs: Observation | None, synced: Synced | None, complete: bool, n_pools: int
) -> GateWant | None:
    """What the gate should say now; None leaves it as it is."""
    if not pod.ready:
        return GateWant(False, "EngineNotReady", "the engine container is not ready")
    if obs is None or not obs.reachable:
        if pod.gate == "True" and synced is not None and not restarted(pod, obs, synced):
            return None  # one failed poll does not take a serving replica out
        return GateWant(
            False, "EngineUnreachable", f"no answer from the engine: {obs and obs.error}"
        )
    if in_service(pod, obs, synced):
        # In service: a pool added later, or lost by hand, is repaired in place.
        return None
    boot = boot_tag(obs.boot_id or "")
    if restarted(pod, obs, synced):
        # Before `complete`: a new operator has no renders yet, and an empty tree is complete.
        return GateWant(
            False, "EngineRestarted", f"engine restarted (boot {boot}); re-materializing pools"
        )
    if complete:
        return GateWant(True, "PoolsMaterialized", boot_message(n_pools, obs.boot_id or ""))
    return GateWant(False, "Materializing", f"materializing {n_pools} declared pools")


def must_drop(pod: ReplicaRef, synced: Synced | None) -> GateWant | None:
    """On a pod event, before any poll: a gate that is True but whose engine stopped, or
    restarted since we synced it, drops at once (a restart empties the engine's KV)."""
    if pod.gate != "True":
        return None
    if not pod.ready:
        return GateWant(False, "EngineNotReady", "the engine container is not ready")
    if synced is not None and pod.restarts != synced.restarts:
        return GateWant(False, "EngineRestarted", "the engine restarted; re-materializing pools")
    return None
