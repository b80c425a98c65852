"""The operator's Prometheus metrics: fleet gauges read at scrape time, event counters."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest

from polykv_operator import metrics
from polykv_operator.fleet import Fleet, Observation
from polykv_operator.policies import engine_policy

from .builders import pod, policy
from .fake_engine import FakeEngine, FakePool


def test_fleet_collector_exports_the_autoscaling_signal() -> None:
    fleet = Fleet()
    st = fleet.get("ns", "eng")
    eng = FakeEngine(refused=2, headroom=2)
    pool = FakePool(1, "root", None, [1], 0, rates=[10.0, 14.0])
    pool.admission = engine_policy(policy("p", targetTpsPerSession=6).spec)
    eng.pools["root"] = pool
    st.pods["a"] = pod("a", "1.1.1.1", gate="True")
    st.replicas["a"] = Observation("a", "uid-a", "1.1.1.1", True, None, eng.listing())
    st.mean_active_tps = 12.0
    reg = CollectorRegistry()
    reg.register(metrics.FleetCollector(lambda: metrics.figures(fleet)))
    text = generate_latest(reg).decode()
    # floor x sessions / their tps: 6 x 2 / 24; (2 active + 2 refused) / (2 + 2 headroom)
    assert 'polykv_engine_floor_pressure{engine="eng",namespace="ns"} 0.5' in text
    assert 'polykv_engine_session_demand_ratio{engine="eng",namespace="ns"} 1.0' in text
    assert 'polykv_engine_replicas_pools_ready{engine="eng",namespace="ns"} 1.0' in text
    assert "polykv_engine_mean_active_tps" in text


def test_a_stale_signal_is_absent_not_old() -> None:
    fleet = Fleet()
    st = fleet.get("ns", "eng")
    eng = FakeEngine()
    st.pods["a"] = pod("a", "1.1.1.1", gate="True")
    st.replicas["a"] = Observation(
        "a", "uid-a", "1.1.1.1", True, None, eng.listing(), at=time.time() - 31
    )
    reg = CollectorRegistry()
    reg.register(metrics.FleetCollector(lambda: metrics.figures(fleet)))
    text = generate_latest(reg).decode()
    assert 'polykv_engine_replicas{engine="eng",namespace="ns"} 1.0' in text
    assert "polykv_engine_floor_pressure{" not in text
    assert "polykv_engine_session_demand_ratio{" not in text


def test_reconcile_counter_is_registered() -> None:
    text = generate_latest(metrics.REGISTRY).decode()
    assert "polykv_operator_reconcile_total" in text
    assert "polykv_operator_engine_poll_seconds" in text


def test_engine_restarts_per_pod_as_a_counter() -> None:
    fleet = Fleet()
    st = fleet.get("ns", "eng")
    st.pods["a"] = pod("a", "1.1.1.1", restarts=3)
    st.pods["b"] = pod("b", "1.1.1.2", terminating=True, restarts=9)  # going away: not counted
    reg = CollectorRegistry()
    reg.register(metrics.FleetCollector(lambda: metrics.figures(fleet)))
    text = generate_latest(reg).decode()
    assert "# TYPE polykv_engine_container_restarts_total counter" in text
    assert 'polykv_engine_container_restarts_total{engine="eng",namespace="ns",pod="a"} 3.0' in text
    assert 'pod="b"' not in text


def test_pool_book_exports_conditions_and_orphaned_pins() -> None:
    book = metrics.PoolBook()
    book.record(metrics.PoolFigures("ns", "crew", "eng", {"Ready": "True"}, orphaned_pin=True))
    book.record(metrics.PoolFigures("ns", "bad", "eng", {"Ready": "False", "Stalled": "True"}))
    reg = CollectorRegistry()
    reg.register(metrics.PoolCollector(book.rows))
    text = generate_latest(reg).decode()
    series = (
        'polykv_operator_pool_condition{{condition="{}",engine="eng",namespace="ns",pool="{}"}}'
    )
    assert series.format("Ready", "crew") + " 1.0" in text
    assert series.format("Stalled", "crew") + " 0.0" in text
    assert series.format("Stalled", "bad") + " 1.0" in text
    assert 'polykv_operator_pool_orphaned_pin{engine="eng",namespace="ns",pool="crew"} 1.0' in text
    book.forget("ns", "crew")
    assert 'pool="crew"' not in generate_latest(reg).decode()
