"""Which replicas to try, in order, for a request that is not bound to one (pure).

``rank`` sees each replica as a ``ReplicaView`` (serving or not, its fresh capacity answer
for the request's pool, how many sessions and requests it carries) and the reservations
made since the capacity was polled. It returns replica names, best first. The router tries
them in that order; the engines' own gate stays authoritative (a 429 moves to the next).

Order, for a new session (``gated=True``):

1. replicas that admit and have headroom left after their reservations;
2. replicas whose capacity for the pool is unknown (new, or not polled yet);
3. replicas that admit but whose headroom the reservations have used up;
4. replicas that refuse (still tried last: the figures may be a poll old).

A re-home (``gated=False``: a continuation the fleet admitted already) ignores ``can_admit``
and orders by tiers 1, 2 and 3 only. Within a tier: the highest projected mean tps if one
more joins (reservations taken into account), then the most headroom, then the lightest
load, then the name (deterministic). Replicas that are not serving, or that lack the pool,
are left out; when that leaves none but some serve, those are returned by load so that the
engine's own answer (404 ``pool_not_found``) reaches the client.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolCapacity:
    """One replica's answer to ``GET /polykv/pools/{pool}/capacity``, the fields we use."""

    can_admit: bool
    reason_code: str
    projected_tps: float | None
    """Mean decode tps of the pool's active sessions if one more joins; None: none active."""
    headroom: int
    """More sessions the replica can take (KV and idle slots)."""
    n_sessions: int
    settling: bool = False


@dataclass(frozen=True, slots=True)
class ReplicaView:
    name: str
    serving: bool
    """Ready and not terminating."""
    capacity: PoolCapacity | None = None
    """A fresh capacity answer for the request's pool; None when unknown."""
    has_pool: bool = True
    """False when the replica answered 404 pool_not_found (freshly)."""
    load: int = 0
    """Sessions bound here by this router plus requests in flight."""


def _projected(cap: PoolCapacity, reserved: int) -> float:
    """The projection with the reserved sessions in it, by the engine's simple model
    (mean · n / (n + 1) per session added): an idle pool (no projection) is the best."""
    if cap.projected_tps is None:
        return math.inf
    n = cap.n_sessions
    return cap.projected_tps * (n + 1) / (n + 1 + reserved)


def _tier(cap: PoolCapacity | None, reserved: int, gated: bool) -> int:
    if cap is None:
        return 1
    if gated and not cap.can_admit:
        return 3
    return 0 if cap.headroom - reserved > 0 else 2


def rank(
    replicas: Iterable[ReplicaView],
    reserved: Mapping[str, int],
    *,
    gated: bool,
    avoid: str | None = None,
) -> list[str]:
    """Replica names, best first. ``avoid`` (a replica that just failed this session) goes
    last whatever its figures, so it is tried only when nothing else is left."""
    views = list(replicas)
    serving = [v for v in views if v.serving]
    usable = [v for v in serving if v.has_pool]
    if not usable:
        order = sorted(serving, key=lambda v: (v.load + reserved.get(v.name, 0), v.name))
        return _last(avoid, [v.name for v in order])

    def key(v: ReplicaView) -> tuple[int, float, int, int, str]:
        r = reserved.get(v.name, 0)
        cap = v.capacity
        if cap is None:
            return (_tier(None, r, gated), -math.inf, 0, v.load + r, v.name)
        return (_tier(cap, r, gated), -_projected(cap, r), -(cap.headroom - r), v.load + r, v.name)

    return _last(avoid, [v.name for v in sorted(usable, key=key)])


def _last(avoid: str | None, names: list[str]) -> list[str]:
    if avoid is not None and avoid in names:
        names.remove(avoid)
        names.append(avoid)
    return names
