"""The operator's Prometheus metrics: fleet gauges read at scrape time, event counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from polykv_operator import metrics
from polykv_operator.fleet import Fleet, Observation
from polykv_operator.policies import engine_policy

from .builders import pod, policy
from .fake_engine import FakeEngine, FakePool


def test_fleet_collector_exports_floor_pressure() -> None:
    fleet = Fleet()
    st = fleet.get("ns", "eng")
    eng = FakeEngine()
    pool = FakePool(1, "root", None, [1], 0)
    pool.admission = engine_policy(policy("p", targetTpsPerSession=6).spec)
    eng.pools["root"] = pool
    st.pods["a"] = pod("a", "1.1.1.1", gate="True")
    st.replicas["a"] = Observation("a", "uid-a", "1.1.1.1", True, None, eng.listing())
    st.mean_active_tps = 12.0
    reg = CollectorRegistry()
    reg.register(metrics.FleetCollector(lambda: metrics.figures(fleet)))
    text = generate_latest(reg).decode()
    assert 'polykv_engine_floor_pressure{engine="eng",namespace="ns"} 0.5' in text
    assert 'polykv_engine_replicas_pools_ready{engine="eng",namespace="ns"} 1.0' in text
    assert "polykv_engine_mean_active_tps" in text


def test_reconcile_counter_is_registered() -> None:
    text = generate_latest(metrics.REGISTRY).decode()
    assert "polykv_operator_reconcile_total" in text
    assert "polykv_operator_engine_poll_seconds" in text
