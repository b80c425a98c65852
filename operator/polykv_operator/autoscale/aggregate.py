"""One PolyKVEngine's autoscaling signal, combined from its replicas' own figures (pure).

Both figures are ratios of sums, so replicas combine by adding numerators and denominators
(never by averaging their ratios):

- floor pressure: for each pool with a floor, floor x Σ active sessions / Σ their tps over
  the replicas (the floor over the fleet's mean_active_tps, as the engines count it); the
  highest of them. Above 1 the pool runs under its floor; replicas added spread the sessions
  and lower it. No floored pool with a measured session: 0.
- session demand ratio: Σ (active + distinct sessions refused in the last 60 s) over
  Σ (active + headroom). An enforced gate holds the mean above the floor by refusing new
  sessions, which hides demand from the floor pressure; the refused count here.

A replica counts once it serves: its readiness gate is True (every declared pool is on it),
it is not terminating, and it answered the last poll. A new replica therefore adds its
(empty) capacity only once its tree is materialized, as the HPA counts it.

Stale: no replica counts, or the oldest figure counted is older than `STALE_AFTER_S`. A stale
signal has no value: every form it is served in says so instead of giving a number (the HPA
then keeps its replica count, and never scales down on old data).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from polykv_api import models as wire

from ..fleet import EngineState

STALE_AFTER_S = 30.0


@dataclass(frozen=True)
class PoolPart:
    """One pool on one replica: its floor (None: no policy) and its active sessions."""

    pool: str
    floor: float | None
    n_active: int
    tps_sum: float


@dataclass(frozen=True)
class ReplicaPart:
    """One replica's additive figures from one poll (`at`: when, epoch seconds)."""

    pod: str
    at: float
    pools: tuple[PoolPart, ...]
    active: int  # sessions processing a turn
    refused: int  # distinct sessions refused in the last 60 s
    headroom: int  # more sessions its free slots and KV would take

    @classmethod
    def from_listing(cls, pod: str, at: float, listing: wire.PoolList) -> ReplicaPart:
        pools = tuple(
            PoolPart(
                # Pool ids differ per replica, names do not: an unnamed pool stays apart.
                p.name if p.name is not None else f"{pod}#{p.pool_id}",
                p.admission.target_tps_per_session if p.admission is not None else None,
                p.n_active,
                p.active_tps_sum,
            )
            for p in listing.pools
        )
        return cls(
            pod,
            at,
            pools,
            listing.sessions_active,
            listing.sessions_refused,
            listing.sessions_headroom,
        )


@dataclass(frozen=True)
class PoolSignal:
    """One pool over the counted replicas."""

    pool: str
    floor: float | None
    n_active: int
    tps_sum: float

    @property
    def floor_pressure(self) -> float | None:
        """floor x n / Σ tps; None without a floor or a measured session."""
        if self.floor is None or self.n_active <= 0 or self.tps_sum <= 0:
            return None
        return self.floor * self.n_active / self.tps_sum


@dataclass(frozen=True)
class Signal:
    """The fleet's figures; `floor_pressure` and `session_demand_ratio` are None when stale."""

    floor_pressure: float | None
    session_demand_ratio: float | None
    pools: tuple[PoolSignal, ...]
    replicas: tuple[str, ...]  # the pods counted
    active: int
    refused: int
    headroom: int
    observed_at: float | None  # the oldest figure counted
    stale: bool
    reason: str  # why stale ("" when fresh)

    def age_s(self, now: float) -> float | None:
        return None if self.observed_at is None else max(0.0, now - self.observed_at)


def demand_ratio(active: int, refused: int, headroom: int) -> float:
    """(active + refused) / (active + headroom): 0 without any demand, and the refused count
    alone when nothing fits (the engine's own per-replica definition, over sums)."""
    if active + refused == 0:
        return 0.0
    return (active + refused) / max(1, active + headroom)


def pools_over(parts: Iterable[ReplicaPart]) -> tuple[PoolSignal, ...]:
    """Each pool's sums over the replicas; its floor is the highest any replica holds (two
    differ only while a policy edit is being pushed)."""
    floors: dict[str, float | None] = {}
    n: dict[str, int] = {}
    tps: dict[str, float] = {}
    for part in parts:
        for p in part.pools:
            have = floors.get(p.pool)
            if p.pool not in floors or (p.floor is not None and (have is None or p.floor > have)):
                floors[p.pool] = p.floor
            n[p.pool] = n.get(p.pool, 0) + p.n_active
            tps[p.pool] = tps.get(p.pool, 0.0) + p.tps_sum
    return tuple(PoolSignal(name, floors[name], n[name], tps[name]) for name in sorted(floors))


def combine(
    parts: Sequence[ReplicaPart], now: float, stale_after_s: float = STALE_AFTER_S
) -> Signal:
    """The fleet's signal from the counted replicas' figures, as of `now`."""
    pools = pools_over(parts)
    active = sum(p.active for p in parts)
    refused = sum(p.refused for p in parts)
    headroom = sum(p.headroom for p in parts)
    oldest = min((p.at for p in parts), default=None)
    reason = ""
    if oldest is None:
        reason = "no replica serves (none has its pools and answered the last poll)"
    elif now - oldest > stale_after_s:
        reason = (
            f"the oldest replica figures are {now - oldest:.0f} s old (limit {stale_after_s:.0f} s)"
        )
    pressures = [x for p in pools if (x := p.floor_pressure) is not None]
    return Signal(
        floor_pressure=None if reason else max(pressures, default=0.0),
        session_demand_ratio=None if reason else demand_ratio(active, refused, headroom),
        pools=pools,
        replicas=tuple(p.pod for p in parts),
        active=active,
        refused=refused,
        headroom=headroom,
        observed_at=oldest,
        stale=bool(reason),
        reason=reason,
    )


def serving(state: EngineState) -> list[ReplicaPart]:
    """The replicas that count, from the last round: gate True, not terminating, answered."""
    out = []
    for name, pod in sorted(state.pods.items()):
        obs = state.replicas.get(name)
        if pod.gate != "True" or pod.terminating or obs is None or obs.uid != pod.uid:
            continue
        if obs.reachable and obs.listing is not None:
            out.append(ReplicaPart.from_listing(name, obs.at, obs.listing))
    return out


def engine_signal(state: EngineState, now: float, stale_after_s: float = STALE_AFTER_S) -> Signal:
    return combine(serving(state), now, stale_after_s)
