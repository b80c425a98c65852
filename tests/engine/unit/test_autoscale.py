"""Autoscaling signals: floor pressure as a ratio of sums, demand that counts refusals."""

from __future__ import annotations

import pytest

from polykv_engine.policy.autoscale import PoolLoad, RecentDistinct, demand_ratio, floor_pressure


def test_floor_pressure_is_the_worst_pool_and_idle_is_zero() -> None:
    assert floor_pressure([]) == 0.0
    assert floor_pressure([PoolLoad(5.0, 0, 0.0)]) == 0.0  # nothing measured: 0, not no data
    assert floor_pressure([PoolLoad(None, 4, 8.0)]) == 0.0  # no floor, no pressure
    loads = [PoolLoad(5.0, 2, 20.0), PoolLoad(4.0, 3, 6.0)]  # means 10 and 2 tok/s
    assert floor_pressure(loads) == pytest.approx(2.0)  # 4 / 2, the pool under its floor


def test_floor_pressure_falls_as_sessions_spread_over_replicas() -> None:
    # The same 6 sessions at a fleet-wide 3 tok/s each, then spread so each runs faster.
    one = floor_pressure([PoolLoad(5.0, 6, 18.0)])
    two = floor_pressure([PoolLoad(5.0, 6, 36.0)])
    assert one > 1 > two


def test_demand_counts_refused_sessions() -> None:
    assert demand_ratio(0, 0, 8) == 0.0
    assert demand_ratio(4, 0, 4) == pytest.approx(0.5)
    assert demand_ratio(4, 6, 0) == pytest.approx(2.5)  # the gate holds the mean up, not demand
    assert demand_ratio(0, 3, 0) == pytest.approx(3.0)


def test_refused_sessions_are_distinct_and_age_out() -> None:
    r = RecentDistinct(window_s=60)
    r.add("a", 0.0)
    r.add("a", 10.0)
    r.add("b", 30.0)
    assert r.count(40.0) == 2
    assert r.count(75.0) == 1  # "a" last seen at 10 s
    assert r.count(100.0) == 0
