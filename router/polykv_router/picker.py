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
and orders by tiers 1, 2 and 3 only. Within a tier, replicas are taken in windows: the best
projected mean tps if one more joins (reservations taken into account) opens a window, and
every replica within ``PROJECTION_WINDOW`` of it is in; inside a window the fewest sessions
of the pool come first (reservations counted), then the most headroom, then the lightest
load, then the name (deterministic). A replica's measured rate is noisy (a turn of a few
tokens on a busy CPU can read half as fast or twice as fast), so near-equal projections must
not pile new sessions onto one replica; its session count, headroom and load are exact. A
replica without a projection (an idle pool with no estimate) ties with the best measured one.
Replicas that are not serving, or that lack the pool, are left out; when that leaves none but
some serve, those are returned by load so that the engine's own answer (404
``pool_not_found``) reaches the client.
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
    """Mean decode tps of the pool's active sessions if one more joins; None: no measured
    load (none active, or only the engine's idle estimate)."""
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
    (mean · n / (n + 1) per session added); inf when the engine gave none."""
    if cap.projected_tps is None:
        return math.inf
    n = cap.n_sessions
    return cap.projected_tps * (n + 1) / (n + 1 + reserved)


PROJECTION_WINDOW = 1.5
"""Projections within this ratio of the best one left rank as equal (noise, not speed)."""


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
        lightest = sorted(serving, key=lambda v: (v.load + reserved.get(v.name, 0), v.name))
        return _last(avoid, [v.name for v in lightest])

    def tier(v: ReplicaView) -> int:
        return _tier(v.capacity, reserved.get(v.name, 0), gated)

    names: list[str] = []
    for t in sorted({tier(v) for v in usable}):
        names += _by_windows([v for v in usable if tier(v) == t], reserved)
    return _last(avoid, names)


def _by_windows(views: list[ReplicaView], reserved: Mapping[str, int]) -> list[str]:
    """One tier's replicas, best first: window after window of near-best projections."""

    def measured(v: ReplicaView) -> float:
        cap = v.capacity
        return math.inf if cap is None else _projected(cap, reserved.get(v.name, 0))

    # No projection (an idle pool the engine has no estimate for, or capacity not polled
    # yet) is no evidence of speed either way: it ties with the best measured replica, and
    # the session counts decide. Ranking it above every figure piled new sessions onto the
    # replicas that happened to have no estimate.
    known = [m for m in map(measured, views) if not math.isinf(m)]
    best_known = max(known, default=math.inf)

    def projected(v: ReplicaView) -> float:
        m = measured(v)
        return best_known if math.isinf(m) else m

    def within(v: ReplicaView) -> tuple[int, int, int, str]:
        r = reserved.get(v.name, 0)
        cap = v.capacity
        sessions, headroom = (0, 0) if cap is None else (cap.n_sessions, cap.headroom)
        return (sessions + r, -(headroom - r), v.load + r, v.name)

    left = sorted(views, key=lambda v: (-projected(v), v.name))
    order: list[str] = []
    while left:
        best = projected(left[0])
        floor = best if math.isinf(best) else best / PROJECTION_WINDOW
        window = [v for v in left if projected(v) >= floor]
        order += [v.name for v in sorted(window, key=within)]
        left = [v for v in left if projected(v) < floor]
    return order


def _last(avoid: str | None, names: list[str]) -> list[str]:
    if avoid is not None and avoid in names:
        names.remove(avoid)
        names.append(avoid)
    return names
