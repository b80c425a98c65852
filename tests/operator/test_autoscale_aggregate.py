"""The fleet's autoscaling signal: ratios of sums over replicas, the highest pool, staleness,
and which replicas count. Cross-checked against the engine's own per-replica definitions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polykv_engine.policy.autoscale import PoolLoad
from polykv_engine.policy.autoscale import demand_ratio as engine_demand_ratio
from polykv_engine.policy.autoscale import floor_pressure as engine_floor_pressure
from polykv_operator.autoscale.aggregate import (
    STALE_AFTER_S,
    PoolPart,
    ReplicaPart,
    combine,
    engine_signal,
)
from polykv_operator.fleet import EngineState, Observation
from polykv_operator.policies import engine_policy

from .builders import pod, policy
from .fake_engine import FakeEngine, FakePool

NOW = 1_000_000.0


def replica(pod: str, *pools: PoolPart, active: int = 0, refused: int = 0, headroom: int = 0,
            at: float = NOW) -> ReplicaPart:  # fmt: skip
    return ReplicaPart(pod, at, pools, active, refused, headroom)


def test_floor_pressure_is_a_ratio_of_sums_not_a_mean_of_ratios() -> None:
    # Replica a: 1 session at 10 tps; b: 3 sessions at 2 tps each. Floor 4.
    a = replica("a", PoolPart("crew", 4.0, 1, 10.0))
    b = replica("b", PoolPart("crew", 4.0, 3, 6.0))
    sig = combine([a, b], NOW)
    # The fleet's mean is 16 tps / 4 sessions = 4: pressure 1.0. Averaging the replicas'
    # pressures (0.4 and 2.0) would say 1.2.
    assert sig.floor_pressure == pytest.approx(1.0)
    assert not sig.stale and sig.replicas == ("a", "b")


def test_floor_pressure_is_the_highest_pool_with_a_floor() -> None:
    parts = [
        replica("a", PoolPart("fast", 10.0, 2, 40.0), PoolPart("slow", 2.0, 2, 2.0)),
        replica("b", PoolPart("fast", 10.0, 2, 40.0), PoolPart("none", None, 9, 1.0)),
    ]
    sig = combine(parts, NOW)
    by_pool = {p.pool: p for p in sig.pools}
    assert by_pool["fast"].floor_pressure == pytest.approx(0.5)
    assert by_pool["slow"].floor_pressure == pytest.approx(2.0)
    assert by_pool["none"].floor_pressure is None  # no floor: whatever its speed
    assert sig.floor_pressure == pytest.approx(2.0)


def test_adding_an_empty_serving_replica_lowers_nothing_but_headroom() -> None:
    busy = replica("a", PoolPart("crew", 5.0, 4, 10.0), active=4, refused=2, headroom=0)
    fresh = replica("b", PoolPart("crew", 5.0, 0, 0.0), active=0, refused=0, headroom=4)
    alone, both = combine([busy], NOW), combine([busy, fresh], NOW)
    assert alone.floor_pressure == both.floor_pressure == pytest.approx(2.0)
    assert alone.session_demand_ratio == pytest.approx(6 / 4)
    assert both.session_demand_ratio == pytest.approx(6 / 8)  # refused demand now fits


def test_idle_fleet_reports_zero_not_nothing() -> None:
    sig = combine([replica("a", PoolPart("crew", 5.0, 0, 0.0), headroom=4)], NOW)
    assert sig.floor_pressure == 0.0 and sig.session_demand_ratio == 0.0 and not sig.stale


def test_refused_demand_with_no_headroom_counts_in_full() -> None:
    sig = combine([replica("a", active=0, refused=3, headroom=0)], NOW)
    assert sig.session_demand_ratio == 3.0


def test_a_floor_being_pushed_counts_at_its_highest() -> None:
    parts = [
        replica("a", PoolPart("crew", 2.0, 1, 4.0)),
        replica("b", PoolPart("crew", None, 1, 4.0)),
    ]
    assert combine(parts, NOW).floor_pressure == pytest.approx(2.0 * 2 / 8)


def test_stale_after_thirty_seconds_and_without_replicas() -> None:
    fresh = replica("a", PoolPart("crew", 5.0, 1, 10.0), at=NOW - STALE_AFTER_S)
    old = replica("b", PoolPart("crew", 5.0, 1, 10.0), at=NOW - STALE_AFTER_S - 0.1)
    assert not combine([fresh], NOW).stale
    sig = combine([fresh, old], NOW)  # one old replica makes the fleet's figure old
    assert sig.stale and sig.floor_pressure is None and sig.session_demand_ratio is None
    assert "30 s old" in sig.reason and sig.observed_at == old.at
    empty = combine([], NOW)
    assert empty.stale and empty.floor_pressure is None and "no replica serves" in empty.reason


@st.composite
def fleets(draw: st.DrawFn) -> list[list[tuple[str, float | None, int, float]]]:
    floors = {p: draw(st.none() | st.floats(0.1, 100)) for p in ("p0", "p1", "p2")}
    n_replicas = draw(st.integers(1, 4))
    out = []
    for _ in range(n_replicas):
        rows = []
        for name, floor in floors.items():
            n = draw(st.integers(0, 6))
            rows.append((name, floor, n, draw(st.floats(0.5, 80)) * n))
        out.append(rows)
    return out


@given(fleets(), st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8))))
def test_the_fleet_figure_is_the_engines_own_figure_over_the_summed_parts(
    fleet: list[list[tuple[str, float | None, int, float]]],
    sessions: list[tuple[int, int, int]],
) -> None:
    """One definition: summing the replicas' additive parts and applying the engine's own
    per-replica formulas gives what the operator serves."""
    counts = [sessions[i] if i < len(sessions) else (0, 0, 0) for i in range(len(fleet))]
    parts = [
        replica(f"r{i}", *(PoolPart(*row) for row in rows), active=a, refused=r, headroom=h)
        for i, (rows, (a, r, h)) in enumerate(zip(fleet, counts, strict=True))
    ]
    sig = combine(parts, NOW)
    merged = [
        PoolLoad(
            floor,
            sum(rows[k][2] for rows in fleet),
            sum(rows[k][3] for rows in fleet),
        )
        for k, (_, floor, _, _) in enumerate(fleet[0])
    ]
    assert sig.floor_pressure == pytest.approx(engine_floor_pressure(merged))
    totals = [sum(c[j] for c in counts) for j in range(3)]
    assert sig.session_demand_ratio == pytest.approx(engine_demand_ratio(*totals))


def test_only_serving_replicas_count() -> None:
    """Gate True, not terminating, answered the last poll, the same pod incarnation."""
    state = EngineState(("ns", "eng"))
    floor = engine_policy(policy("p", targetTpsPerSession=2.5).spec)

    def engine(*rates: float) -> FakeEngine:
        eng = FakeEngine(headroom=1)
        eng.pools["crew"] = FakePool(1, "crew", None, [1], 0, admission=floor, rates=list(rates))
        return eng

    rows = {
        "ready": (pod("ready", "10.0.0.1", gate="True"), engine(5.0)),
        "new": (pod("new", "10.0.0.2", gate="False"), engine()),  # tree not materialized yet
        "leaving": (pod("leaving", "10.0.0.3", gate="True", terminating=True), engine(1.0)),
        "silent": (pod("silent", "10.0.0.4", gate="True"), None),
    }
    for name, (p, eng) in rows.items():
        state.pods[name] = p
        listing = eng.listing() if eng is not None else None
        state.replicas[name] = Observation(name, p.uid, p.ip, eng is not None, None, listing)
    sig = engine_signal(state, state.replicas["ready"].at)
    assert sig.replicas == ("ready",)
    assert sig.floor_pressure == pytest.approx(2.5 / 5.0)
    assert sig.headroom == 1 and sig.active == 1
    # A restarted pod's old observation (another uid) does not count either.
    state.replicas["ready"] = Observation("ready", "uid-old", "10.0.0.1", True, None, None)
    assert engine_signal(state, state.replicas["ready"].at).stale
