"""Prometheus metrics of the operator (names prefixed polykv_, labels low-cardinality).

Event counts and latencies are plain Counters/Histograms; fleet gauges come from a
Collector that reads the in-memory fleet at scrape time, so they never go stale.
KEDA's prometheus scaler (or prometheus-adapter) reads each engine fleet's autoscaling signal
(autoscale/aggregate.py) as `polykv_engine_floor_pressure` and
`polykv_engine_session_demand_ratio`; both fall as replicas are added, and both are absent
while the fleet's figures are stale (no value rather than an old one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .autoscale.aggregate import engine_signal
from .fleet import Fleet, Render

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "polykv_operator_reconcile",
    "Handler runs by kind and result (ok, retry, error, permanent)",
    ["kind", "handler", "result"],
    registry=REGISTRY,
)
POLLS = Histogram(
    "polykv_operator_engine_poll_seconds",
    "Time to poll one engine replica (one GET /polykv/pools, capacity included)",
    ["result"],
    registry=REGISTRY,
)
ENGINE_CALLS = Histogram(
    "polykv_operator_engine_request_seconds",
    "Engine API calls by operation and result (ok, rejected, error)",
    ["op", "result"],
    registry=REGISTRY,
)
ROUNDS = Counter(
    "polykv_operator_engine_rounds",
    "Engine rounds (poll, converge, gate) by result",
    ["result"],
    registry=REGISTRY,
)


class EngineFigures:
    """One engine's figures at scrape time."""

    def __init__(
        self,
        namespace: str,
        engine: str,
        replicas: int,
        synced: int,
        pools: int,
        mean_active_tps: float | None,
        floor_pressure: float | None,
        unmanaged_pools: int = 0,
        orphaned_pins: int = 0,
        restarts: dict[str, int] | None = None,
        session_demand_ratio: float | None = None,
    ) -> None:
        self.namespace, self.engine = namespace, engine
        self.replicas, self.synced, self.pools = replicas, synced, pools
        self.mean_active_tps, self.floor_pressure = mean_active_tps, floor_pressure
        self.unmanaged_pools, self.orphaned_pins = unmanaged_pools, orphaned_pins
        self.restarts = restarts or {}  # pod name -> the engine container's restart count
        self.session_demand_ratio = session_demand_ratio


class FleetCollector(Collector):
    """Gauges read from the fleet when Prometheus scrapes."""

    def __init__(self, figures: Callable[[], list[EngineFigures]]) -> None:
        self.figures = figures

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["namespace", "engine"]
        replicas = GaugeMetricFamily(
            "polykv_engine_replicas", "Engine pods that exist", labels=labels
        )
        synced = GaugeMetricFamily(
            "polykv_engine_replicas_pools_ready",
            "Engine pods whose readiness gate is True (every declared pool on them)",
            labels=labels,
        )
        pools = GaugeMetricFamily(
            "polykv_engine_pools", "Declared pools materialized on every replica", labels=labels
        )
        tps = GaugeMetricFamily(
            "polykv_engine_mean_active_tps",
            "Mean experienced decode tokens/s of the fleet's decoding sessions",
            labels=labels,
        )
        pressure = GaugeMetricFamily(
            "polykv_engine_floor_pressure",
            "Max over pools with a floor of floor x sessions / their tps, summed over the "
            "serving replicas (absent while stale)",
            labels=labels,
        )
        demand = GaugeMetricFamily(
            "polykv_engine_session_demand_ratio",
            "(active + refused in the last 60 s) / (active + headroom) sessions, summed over "
            "the serving replicas (absent while stale)",
            labels=labels,
        )
        unmanaged = GaugeMetricFamily(
            "polykv_engine_unmanaged_pools",
            "Pools on the replicas that no PolyKVPool declares (made through the engine API)",
            labels=labels,
        )
        orphaned = GaugeMetricFamily(
            "polykv_engine_orphaned_pins",
            "Undeclared pools pinned with no sessions and no children (KV nobody releases)",
            labels=labels,
        )
        restarts = CounterMetricFamily(
            "polykv_engine_container_restarts",
            "Restarts of each engine pod's engine container (the pod's restartCount)",
            labels=[*labels, "pod"],
        )
        for f in self.figures():
            key = [f.namespace, f.engine]
            for pod, count in sorted(f.restarts.items()):
                restarts.add_metric([*key, pod], count)
            replicas.add_metric(key, f.replicas)
            synced.add_metric(key, f.synced)
            pools.add_metric(key, f.pools)
            unmanaged.add_metric(key, f.unmanaged_pools)
            orphaned.add_metric(key, f.orphaned_pins)
            if f.mean_active_tps is not None:
                tps.add_metric(key, f.mean_active_tps)
            if f.floor_pressure is not None:
                pressure.add_metric(key, f.floor_pressure)
            if f.session_demand_ratio is not None:
                demand.add_metric(key, f.session_demand_ratio)
        yield from (
            replicas,
            synced,
            pools,
            tps,
            pressure,
            demand,
            unmanaged,
            orphaned,
            restarts,
        )


@dataclass(frozen=True)
class PoolFigures:
    """One declared pool as its engine's round last computed its status."""

    namespace: str
    pool: str
    engine: str
    conditions: dict[str, str] = field(default_factory=dict)  # type -> "True"/"False"/...
    orphaned_pin: bool = False


class PoolBook:
    """The declared pools' last statuses, written by the engine rounds, read at scrape time
    (alerts on Stalled pools and orphaned pins need them as series)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # scrapes run on the metrics server's thread
        self._rows: dict[tuple[str, str], PoolFigures] = {}

    def record(self, row: PoolFigures) -> None:
        with self._lock:
            self._rows[(row.namespace, row.pool)] = row

    def forget(self, namespace: str, pool: str) -> None:
        with self._lock:
            self._rows.pop((namespace, pool), None)

    def rows(self) -> list[PoolFigures]:
        with self._lock:
            return sorted(self._rows.values(), key=lambda r: (r.namespace, r.pool))


POOLS = PoolBook()


class PoolCollector(Collector):
    """Per declared pool: its kstatus conditions (1 when True) and its orphaned pin."""

    def __init__(self, rows: Callable[[], list[PoolFigures]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["namespace", "pool", "engine"]
        cond = GaugeMetricFamily(
            "polykv_operator_pool_condition",
            "A declared pool's condition (Ready, Reconciling, Stalled): 1 when True, else 0",
            labels=[*labels, "condition"],
        )
        orphaned = GaugeMetricFamily(
            "polykv_operator_pool_orphaned_pin",
            "1 when the pool is pinned on some replica with no sessions and no children",
            labels=labels,
        )
        for r in self.rows():
            key = [r.namespace, r.pool, r.engine]
            for ctype in ("Ready", "Reconciling", "Stalled"):
                cond.add_metric([*key, ctype], 1.0 if r.conditions.get(ctype) == "True" else 0.0)
            orphaned.add_metric(key, 1.0 if r.orphaned_pin else 0.0)
        yield from (cond, orphaned)


def serve(port: int, address: str = "0.0.0.0") -> None:
    start_http_server(port, addr=address, registry=REGISTRY)


def figures(fleet: Fleet) -> list[EngineFigures]:
    """Per engine, from the fleet's last rounds."""
    out = []
    now = time.time()
    for (ns, name), state in list(fleet.engines.items()):
        pods = [p for p in state.pods.values() if not p.terminating]
        signal = engine_signal(state, now)
        out.append(
            EngineFigures(
                ns,
                name,
                replicas=len(pods),
                synced=len([p for p in pods if p.gate == "True"]),
                pools=len([r for r in state.renders.values() if isinstance(r, Render)]),
                mean_active_tps=state.mean_active_tps,
                floor_pressure=signal.floor_pressure,
                session_demand_ratio=signal.session_demand_ratio,
                unmanaged_pools=state.unmanaged_pools,
                orphaned_pins=state.orphaned_pins,
                restarts={p.name: p.restarts for p in pods},
            )
        )
    return out
