"""Which engine pods need their pod-deletion-cost annotation written, and to what (pure).

A ReplicaSet scaling down deletes the ready pod with the lowest
`controller.kubernetes.io/pod-deletion-cost` first. The cost of an engine pod is the number
of sessions its replica holds (pooled or not, running a turn or between turns): a scale-down
removes the replica whose loss re-prefills the fewest agents, and the engine's graceful
shutdown lets the turns still running there finish.

The engine round computes the wanted values after each poll and writes only changes. The
pod index lags a write by a moment, so `Sent` remembers what was sent against the value
the index showed then: until the index moves, the same value is not sent again; once it
moves (our write arrived, or someone else wrote), the index is the reference again.
`Sent` entries of pods that are gone are dropped by the round (their uids never return).
"""

from __future__ import annotations

from collections.abc import Mapping

from polykv_api import models as wire

from ..fleet import Observation, ReplicaRef


def held_sessions(listing: wire.PoolList) -> int:
    """Sessions holding KV on the replica: attached to a pool, or outside any."""
    return len(listing.unpooled_sessions) + sum(len(p.sessions) for p in listing.pools)


Sent = dict[str, tuple[str, str | None]]
"""pod uid -> (the value sent, the annotation the index showed when it was sent); kept in
the engine's state (`EngineState.costs_sent`)."""


def needs(sent: Sent, pod: ReplicaRef, value: str) -> bool:
    if pod.deletion_cost == value:
        return False
    return sent.get(pod.uid) != (value, pod.deletion_cost)


def record(sent: Sent, pod: ReplicaRef, value: str) -> None:
    sent[pod.uid] = (value, pod.deletion_cost)


def wanted(
    pods: Mapping[str, ReplicaRef], replicas: Mapping[str, Observation], sent: Sent
) -> dict[str, str]:
    """pod name -> the cost to write now. Pods whose replica did not answer the last poll
    (or is leaving) keep what they have: no figure is better than a guess."""
    out: dict[str, str] = {}
    for name, pod in pods.items():
        obs = replicas.get(name)
        if pod.terminating or obs is None or obs.uid != pod.uid:
            continue
        if not obs.reachable or obs.listing is None:
            continue
        value = str(held_sessions(obs.listing))
        if needs(sent, pod, value):
            out[name] = value
    return out
