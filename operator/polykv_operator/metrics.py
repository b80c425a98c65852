"""Prometheus metrics of the operator (names prefixed polykv_, labels low-cardinality).

Event counts and latencies are plain Counters/Histograms; fleet gauges come from a
Collector that reads the in-memory fleet at scrape time, so they never go stale.
HPA/KEDA read `polykv_engine_floor_pressure` (target tps / mean active tps; above 1 means
sessions run below the floor), a figure that falls as replicas are added.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

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
    ) -> None:
        self.namespace, self.engine = namespace, engine
        self.replicas, self.synced, self.pools = replicas, synced, pools
        self.mean_active_tps, self.floor_pressure = mean_active_tps, floor_pressure
        self.unmanaged_pools, self.orphaned_pins = unmanaged_pools, orphaned_pins


class FleetCollector(Collector):
    """Gauges read from the fleet when Prometheus scrapes."""

    def __init__(self, figures: Callable[[], list[EngineFigures]]) -> None:
        self.figures = figures

    def collect(self) -> Iterator[GaugeMetricFamily]:
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
            "Highest admission floor over the engine's pools divided by mean active tps",
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
        for f in self.figures():
            key = [f.namespace, f.engine]
            replicas.add_metric(key, f.replicas)
            synced.add_metric(key, f.synced)
            pools.add_metric(key, f.pools)
            unmanaged.add_metric(key, f.unmanaged_pools)
            orphaned.add_metric(key, f.orphaned_pins)
            if f.mean_active_tps is not None:
                tps.add_metric(key, f.mean_active_tps)
            if f.floor_pressure is not None:
                pressure.add_metric(key, f.floor_pressure)
        yield from (replicas, synced, pools, tps, pressure, unmanaged, orphaned)


def serve(port: int) -> None:
    start_http_server(port, registry=REGISTRY)


def figures(fleet: Fleet) -> list[EngineFigures]:
    """Per engine, from the fleet's last rounds."""
    out = []
    for (ns, name), state in list(fleet.engines.items()):
        pods = [p for p in state.pods.values() if not p.terminating]
        floor = None
        if state.mean_active_tps:
            targets = [
                float(p.admission.target_tps_per_session)
                for o in state.replicas.values()
                if o.listing is not None
                for p in o.listing.pools
                if p.admission is not None
            ]
            if targets:
                floor = round(max(targets) / state.mean_active_tps, 3)
        out.append(
            EngineFigures(
                ns,
                name,
                replicas=len(pods),
                synced=len([p for p in pods if p.gate == "True"]),
                pools=len([r for r in state.renders.values() if isinstance(r, Render)]),
                mean_active_tps=state.mean_active_tps,
                floor_pressure=floor,
                unmanaged_pools=state.unmanaged_pools,
                orphaned_pins=state.orphaned_pins,
            )
        )
    return out
