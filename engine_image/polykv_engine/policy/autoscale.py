"""Autoscaling signals (pure, callers pass times).

An HPA scales up while its metric is above target and expects the metric to fall as
replicas are added. Raw mean_active_tps does the opposite, so the signals are:

* floor pressure = floor / mean_active_tps = floor x sessions / Σ tps, the highest over the
  pools with a floor: above 1 the pool runs under its floor; adding replicas spreads the
  sessions and lowers it. Idle (no measured session) is 0, never "no data".
* session demand ratio = (active sessions + distinct sessions refused recently) /
  (active sessions + headroom): an enforced gate keeps the mean above the floor by refusing
  sessions, which hides demand from floor pressure; refusals count here, so they scale too.

Both are ratios of sums, so replicas combine by adding numerators and denominators (the
engines export the additive parts), never by averaging ratios.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

REFUSED_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """One pool on one replica: its floor (None without a policy) and active sessions."""

    floor: float | None
    n_active: int
    tps_sum: float


def floor_pressure(pools: Iterable[PoolLoad]) -> float:
    """max over pools with a floor of floor x n_active / Σ tps (0 when nothing is measured)."""
    worst = 0.0
    for p in pools:
        if p.floor is not None and p.n_active > 0 and p.tps_sum > 0:
            worst = max(worst, p.floor * p.n_active / p.tps_sum)
    return worst


def demand_ratio(active: int, refused: int, headroom: int) -> float:
    """(active + refused) / (active + headroom); 0 when there is no demand at all, and the
    refused count alone when nothing fits (a saturated replica with no headroom)."""
    if active + refused == 0:
        return 0.0
    return (active + refused) / max(1, active + headroom)


@dataclass(slots=True)
class RecentDistinct:
    """Distinct keys seen within the last ``window_s`` seconds (sessions refused)."""

    window_s: float = REFUSED_WINDOW_S
    _last: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, now: float) -> None:
        self._last[key] = now

    def count(self, now: float) -> int:
        cutoff = now - self.window_s
        for key in [k for k, t in self._last.items() if t < cutoff]:
            del self._last[key]
        return len(self._last)
