"""The pod readiness gate (names.GATE), decided as a pure function.

A replica joins the Service only once its whole declared tree (and its admission policies)
is on it. A replica whose engine process restarted has lost its pools: its gate drops
before anything is re-materialized, and rises again only when the tree is back.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fleet import Observation, ReplicaRef, Synced


@dataclass(frozen=True)
class GateWant:
    status: bool
    reason: str
    message: str


def restarted(pod: ReplicaRef, obs: Observation | None, synced: Synced | None) -> bool:
    """The engine process is not the one whose gate we turned True."""
    if synced is None:
        return False
    if pod.restarts != synced.restarts:
        return True
    return obs is not None and obs.boot_id is not None and obs.boot_id != synced.boot_id


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
    again = restarted(pod, obs, synced)
    if pod.gate == "True" and synced is not None and not again:
        # In service: a pool added later, or lost by hand, is repaired in place.
        return None
    boot = (obs.boot_id or "")[:12]
    if complete:
        return GateWant(True, "PoolsMaterialized", f"{n_pools} declared pools on boot {boot}")
    if again:
        return GateWant(
            False, "EngineRestarted", f"engine restarted (boot {boot}); re-materializing pools"
        )
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
