"""Prometheus metrics, ``polykv_router_*``. Labels are low-cardinality by construction: a
fixed set of results and reasons, route paths from a fixed table; never a session id, a pool
name or a pod name."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Added latency is small (sub-millisecond to a few ms); the engine's own time is not in it.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "polykv_router_requests",
            "Requests answered, by route and HTTP status",
            ["route", "status"],
            registry=r,
        )
        self.placements = Counter(
            "polykv_router_placements",
            "New sessions and one-shot requests: placed (first choice), retried (after a "
            "refusal), error (an engine error passed through), rejected (every replica "
            "refused), unavailable (no replica reachable)",
            ["result"],
            registry=r,
        )
        self.rehomes = Counter(
            "polykv_router_rehomes",
            "Continuations moved to another replica because theirs was gone: pod_gone, "
            "restarted (boot id changed), unreachable, draining, lost (it refused the session)",
            ["reason"],
            registry=r,
        )
        self.fleet_rejects = Counter(
            "polykv_router_fleet_rejects",
            "429s the router answered because every replica it tried refused, by reason",
            ["reason"],
            registry=r,
        )
        self.engine_refusals = Counter(
            "polykv_router_engine_refusals",
            "Refusals from one engine (429, or 503 while loading or draining), by reason",
            ["reason"],
            registry=r,
        )
        self.lookups = Counter(
            "polykv_router_session_lookups",
            "Sessions the router did not know, asked of every replica: found or not_found",
            ["result"],
            registry=r,
        )
        self.key_checks = Counter(
            "polykv_router_key_checks",
            "Client credentials checked with an engine (one call each; verdicts are cached): "
            "accepted, refused, unanswered (that replica did not answer; the next is asked)",
            ["result"],
            registry=r,
        )
        self.added_latency = Histogram(
            "polykv_router_added_latency_seconds",
            "Time the router spent on a request before sending it upstream (parsing, lookup, "
            "choosing), by kind: continuation, new, oneshot, rehome, other",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def add_state(self, state: Callable[[], State]) -> None:
        """Gauges read at scrape time: bound sessions, replicas by state, polled pools,
        cached key verdicts."""
        self.registry.register(_StateCollector(state))


@dataclass(frozen=True, slots=True)
class State:
    sessions: int
    replicas: dict[str, int]
    pools: int
    keys: int


class _StateCollector(Collector):
    def __init__(self, state: Callable[[], State]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        s = self.state()
        g = GaugeMetricFamily("polykv_router_sessions", "Sessions bound to a replica (cached)")
        g.add_metric([], s.sessions)
        yield g
        g = GaugeMetricFamily("polykv_router_polled_pools", "Pools whose capacity is polled")
        g.add_metric([], s.pools)
        yield g
        g = GaugeMetricFamily("polykv_router_key_verdicts", "Client key verdicts cached")
        g.add_metric([], s.keys)
        yield g
        replicas = s.replicas
        r = GaugeMetricFamily(
            "polykv_router_replicas",
            "Engine replicas known, by state: serving, terminating, not_ready",
            labels=["state"],
        )
        for state, n in sorted(replicas.items()):
            r.add_metric([state], n)
        yield r
