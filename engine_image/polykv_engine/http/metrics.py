"""Prometheus metrics, read from the engine's published snapshot at scrape time.

Names carry the ``polykv_`` prefix (underscores only; colons belong to recording rules) and
labels stay low-cardinality: never a session id or prompt text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from polykv_api.models import SnapshotRefusal
from polykv_engine.core.snapshot import EngineSnapshot
from polykv_engine.llama.cpus import throttled_seconds
from polykv_engine.persist.store import SnapshotStore
from polykv_engine.policy.autoscale import demand_ratio
from polykv_engine.policy.step_time import StepCurve

_COUNTERS: list[tuple[str, str, str]] = [
    ("prompt_tokens", "prompt_tokens", "Prompt tokens computed (not served from cache)"),
    ("prompt_seconds", "prompt_seconds", "Time spent processing prompts"),
    ("prompt_cache_tokens", "cache_tokens", "Prompt tokens reused from the KV cache"),
    ("tokens_predicted", "predicted_tokens", "Generated tokens"),
    ("tokens_predicted_seconds", "predicted_seconds", "Time spent generating"),
    ("tokens_decoded", "decoded_tokens", "Generated tokens, counted at every step"),
    ("tokens_prefilled", "prefilled_tokens", "Prompt and pool tokens computed, every step"),
    ("loop_busy_seconds", "busy_seconds", "Engine loop time spent on iterations with work"),
    ("decode_calls", "decode_calls", "llama_decode calls (engine steps)"),
    ("decode_seconds", "decode_seconds", "Time spent inside llama_decode"),
    ("step_seconds", "step_seconds", "Time spent in engine steps, decode included"),
    ("kv_cache_full", "kv_full_events", "Times llama_decode found no free KV cells"),
    ("context_shifts", "context_shifts", "Context shifts performed"),
    ("kv_parked_tokens", "kv_parked_tokens", "Idle caches' cells moved to host memory"),
    ("kv_unparked_tokens", "kv_unparked_tokens", "Parked cells put back for a next turn"),
    (
        "kv_park_dropped_tokens",
        "kv_park_dropped_tokens",
        "Parked cells discarded to stay within --polykv-park-mib",
    ),
    ("spec_draft_tokens", "spec_draft_tokens", "Tokens speculative decoding drafted"),
    (
        "spec_accepted_tokens",
        "spec_accepted_tokens",
        "Drafted tokens the sampler kept (each a decode step saved)",
    ),
    (
        "prefill_paced_steps",
        "prefill_paced_steps",
        "Steps whose prompt work was cut to the budget that keeps decoding sessions' floor",
    ),
]


class EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        c = snap.counters
        for name, attr, doc in _COUNTERS:
            yield CounterMetricFamily(f"polykv_{name}", doc, value=getattr(c, attr))
        requests = CounterMetricFamily(
            "polykv_requests", "Completion requests by outcome", labels=["outcome"]
        )
        requests.add_metric(["done"], c.requests_done)
        requests.add_metric(["cancelled"], c.requests_cancelled)
        requests.add_metric(["failed"], c.requests_failed)
        yield requests

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"polykv_{name}", doc, value=value)

        yield gauge("ready", "1 when the model is loaded and serving", 1.0 if snap.ready else 0.0)
        yield gauge("slots_total", "Decoding slots (--parallel)", len(snap.slots))
        yield gauge("requests_processing", "Requests holding a slot", snap.n_processing)
        yield gauge("requests_deferred", "Requests waiting for a slot", snap.n_waiting)
        yield gauge("aggregate_decode_tps", "Decoded tokens/s, all sessions", snap.aggregate_tps)
        yield gauge("prefill_tps", "Prompt tokens/s processed", snap.prefill_tps)
        yield gauge(
            "prefill_pending_tokens",
            "Prompt tokens the engine has promised to compute (prefilling or queued)",
            snap.prefill_pending,
        )
        active = snap.active
        yield gauge(
            "mean_active_tps",
            "Mean experienced decode tps of decoding, non-warming sessions",
            active.mean,
        )
        yield gauge("sessions_warming", "Sessions decoding with no rate yet", active.n_warming)
        yield gauge(
            "kept_prefixes",
            "Prefixes kept for cache_control breakpoints, every tenant's (no per-pool series)",
            sum(1 for p in snap.pools if p.owner is not None),
        )
        yield gauge("kv_cells_used", "KV cells holding tokens", snap.kv_cells_used)
        yield gauge("kv_cells_total", "KV cells in the cache", snap.kv_cells_total)
        yield gauge(
            "kv_parked_bytes", "Host memory holding parked idle caches", snap.kv_parked_bytes
        )
        yield curve_family(
            "polykv_decode_step_seconds",
            "Measured time of a decode-only step, by sessions in the batch (admission's curve)",
            snap.step_curve,
        )
        yield curve_family(
            "polykv_decode_cycle_seconds",
            "Measured time between two tokens of a decoding session, any step (prompt chunks "
            "and loop included), by sessions in the batch, decoding or prefilling (admission's "
            "cap)",
            snap.cycle_curve,
        )
        yield from llama_server_series(snap)


def curve_family(name: str, doc: str, curve: StepCurve) -> GaugeMetricFamily:
    """One step-time curve as a gauge family, a series per measured batch size."""
    family = GaugeMetricFamily(name, doc, labels=["batch"])
    for b, seconds in curve.points:
        family.add_metric([str(b)], seconds)
    return family


def llama_server_series(snap: EngineSnapshot) -> Iterator[Metric]:
    """The ``llamacpp:*`` series llama-server exports, same names and meaning, so existing
    llama-server dashboards and alerts keep working against a PolyKV engine."""
    c = snap.counters

    def rate(n: float, seconds: float) -> float:
        return n / seconds if seconds > 0 else 0.0

    for name, doc, value in (
        ("prompt_tokens", "Number of prompt tokens processed, excluding cached", c.prompt_tokens),
        ("prompt_tokens_cached", "Number of prompt tokens reused from the cache", c.cache_tokens),
        ("prompt_seconds", "Total time spent processing prompts", c.prompt_seconds),
        ("tokens_predicted", "Number of generation tokens processed", c.predicted_tokens),
        ("tokens_predicted_seconds", "Total time spent generating tokens", c.predicted_seconds),
        ("n_decode", "Total number of llama_decode() calls", c.decode_calls),
    ):
        yield CounterMetricFamily(f"llamacpp:{name}", doc, value=value)
    for name, doc, value in (
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", c.tokens_max),
        (
            "prompt_tokens_seconds",
            "Average prompt throughput in tokens/s",
            rate(c.prompt_tokens, c.prompt_seconds),
        ),
        (
            "predicted_tokens_seconds",
            "Average generation throughput in tokens/s",
            rate(c.predicted_tokens, c.predicted_seconds),
        ),
        ("requests_processing", "Number of requests processing", snap.n_processing),
        ("requests_deferred", "Number of requests deferred", snap.n_waiting),
        (
            "n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            # llama-server has no pool builds: a step that only built pools is not a
            # decode of its slots, so it would pull the average below one
            c.busy_slot_steps / max(c.slot_decode_calls, 1),
        ),
    ):
        yield GaugeMetricFamily(f"llamacpp:{name}", doc, value=value)


@dataclass(frozen=True, slots=True)
class PoolGauges:
    """Per-pool values, computed by the /metrics handler just before a scrape."""

    label: str
    sessions: int
    own_kv_bytes: int
    subtree_kv_bytes: int
    gen_throughput_tps: float
    mean_active_tps: float
    compaction_pressure: float
    active_sessions: int  # decoding with a measured rate: the additive parts of the mean,
    active_tps_sum: float  # so replicas combine as Σ tps_sum / Σ active_sessions
    floor_tps: float  # the admission floor (0 without a policy)
    refused_sessions: int  # distinct sessions refused in the last minute


_POOL_GAUGES: list[tuple[str, str]] = [
    ("sessions", "Sessions attached to the pool"),
    ("own_kv_bytes", "KV bytes of the pool's own range [D, L)"),
    ("subtree_kv_bytes", "KV bytes of the pool, its descendants and their sessions"),
    ("gen_throughput_tps", "Decode tokens/s of the pool's sessions"),
    ("mean_active_tps", "Mean experienced tps of the pool's decoding sessions"),
    ("compaction_pressure", "0..1: how close the pool's sessions are to running out of KV"),
    ("active_sessions", "Sessions decoding with a measured rate (mean_active_tps's count)"),
    ("active_tps_sum", "Σ experienced tps of those sessions (mean_active_tps's sum)"),
    ("floor_tps", "The admission floor per session, 0 without a policy"),
    ("refused_sessions", "Distinct sessions the gate refused in the last 60 s"),
]


class PoolCollector(Collector):
    def __init__(self, gauges: Callable[[], list[PoolGauges]]) -> None:
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        rows = self._gauges()
        for attr, doc in _POOL_GAUGES:
            fam = GaugeMetricFamily(f"polykv_pool_{attr}", doc, labels=["pool"])
            for row in rows:
                fam.add_metric([row.label], float(getattr(row, attr)))
            yield fam


class PoolCounters:
    """Per-pool counters. A released pool's series are removed: agents create and release
    ephemeral pools all day, and their label sets must not pile up in every scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"polykv_pool_{name}", doc, ["pool"], registry=registry)

        self.admits = counter("admits", "New sessions admitted to a pool")
        self.holds = counter("holds", "Attaches held while a pool settled or queued")
        self.overcommits = counter("overcommits", "Attaches that bypassed the gate")
        self.rehomes = counter(
            "rehomed_sessions",
            "Sessions moved here by a router from a replica that went away (never gated)",
        )
        self.queries = counter("queries", "Requests attached to the pool")
        self.prefix_hits = counter("prefix_hits", "Requests that reused a pool's cached prefix")
        self.rejects = Counter(
            "polykv_pool_rejects",
            "New sessions refused by an enforced policy, by reason code",
            ["pool", "reason"],
            registry=registry,
        )
        self._reasons: dict[str, set[str]] = {}

    def reject(self, pool: str, reason: str) -> None:
        self._reasons.setdefault(pool, set()).add(reason)
        self.rejects.labels(pool, reason).inc()

    def forget(self, pool: str) -> None:
        for c in (self.admits, self.holds, self.overcommits, self.rehomes, self.queries,
                  self.prefix_hits):  # fmt: skip
            with contextlib.suppress(KeyError):
                c.remove(pool)
        for reason in self._reasons.pop(pool, ()):
            with contextlib.suppress(KeyError):
                self.rejects.remove(pool, reason)


class AutoscaleCollector(Collector):
    """The engine's own autoscaling signals and their additive parts, always present (an
    idle engine reports 0, never no data: scale-down needs a value)."""

    def __init__(self, figures: Callable[[], tuple[float, int, int, int]]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        pressure, active, refused, headroom = self._figures()
        for name, doc, value in (
            ("floor_pressure", "max over floored pools of floor / mean_active_tps", pressure),
            ("sessions_active", "Sessions processing a turn", active),
            ("sessions_refused", "Distinct sessions refused in the last 60 s", refused),
            ("sessions_headroom", "More sessions the free slots and KV would take", headroom),
            (
                "session_demand_ratio",
                "(active + refused) / (active + headroom)",
                demand_ratio(active, refused, headroom),
            ),
        ):
            yield GaugeMetricFamily(f"polykv_{name}", doc, value=value)


@dataclass(frozen=True, slots=True)
class ComputeThreads:
    threads: int
    omp_wait: str
    cpu_limit: float | None


class CpuCollector(Collector):
    """What decoding runs on, and whether a CPU limit holds it back: a throttled engine's
    threads stop together at every graph barrier, so its decode rate falls off a cliff."""

    def __init__(self, compute: Callable[[], ComputeThreads | None]) -> None:
        self._compute = compute

    def collect(self) -> Iterator[Metric]:
        compute = self._compute()
        if compute is not None:
            threads = GaugeMetricFamily(
                "polykv_compute_threads",
                "Compute threads for decoding, by how they wait between graphs",
                labels=["omp_wait"],
            )
            threads.add_metric([compute.omp_wait], compute.threads)
            yield threads
            if compute.cpu_limit is not None:
                yield GaugeMetricFamily(
                    "polykv_cpu_limit_cores", "The cgroup's CPU limit", value=compute.cpu_limit
                )
        throttled = throttled_seconds()
        if throttled is not None:
            yield CounterMetricFamily(
                "polykv_cpu_throttled_seconds",
                "Time the CPU limit held this engine's cgroup back (cgroup cpu.stat)",
                value=throttled,
            )


REFUSALS: tuple[str, ...] = SnapshotRefusal.__args__  # type: ignore[attr-defined]
WRITE_SKIPS = ("too_large", "busy", "disk_full", "write_failed")
SESSION_SAVES = ("written", "over_budget", "deadline", "not_whole", "not_written")
SESSION_RESTORES = ("restored", "refused", "unused")
RESTORE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class SnapshotCollector(Collector):
    """The KV snapshot store's totals (nothing when the engine keeps no snapshots). Every
    reason has a series from boot on, so a rate over a first refusal is never missed."""

    def __init__(self, store: Callable[[], SnapshotStore | None]) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        store = self._store()
        if store is None:
            return
        st = store.stats_now()
        yield CounterMetricFamily(
            "polykv_snapshot_bytes_written", "Bytes of KV snapshots written", value=st.bytes_written
        )
        read = CounterMetricFamily(
            "polykv_snapshot_bytes_read",
            "Bytes of KV snapshots read, from this replica's store or a peer's",
            labels=["source"],
        )
        for source in ("store", "peer"):
            read.add_metric([source], st.bytes_read[source])
        yield read
        for name, label, doc, reasons, counts in (
            ("snapshot_refusals", "reason",
             "Snapshots not restored, by reason (the pool or session turn was prefilled)",
             REFUSALS, st.refusals),
            ("snapshot_writes_skipped", "reason",
             "Snapshots not written, by reason (serving went on)", WRITE_SKIPS, st.skipped),
            ("session_saves", "outcome",
             "Sessions' caches at shutdown: written, or why not", SESSION_SAVES,
             st.session_saves),
            ("session_restores", "outcome",
             "Saved session caches at their next turn: restored, refused (prefilled), or "
             "unused (the prompt did not continue them)", SESSION_RESTORES,
             st.session_restores),
        ):  # fmt: skip
            fam = CounterMetricFamily(f"polykv_{name}", doc, labels=[label])
            for reason in reasons:
                fam.add_metric([reason], counts[reason])
            yield fam
        yield GaugeMetricFamily(
            "polykv_snapshot_store_bytes", "Bytes the snapshot store holds", value=store.used_bytes
        )
        yield GaugeMetricFamily(
            "polykv_snapshot_store_max_bytes",
            "The store's bound (--polykv-snapshot-mib)",
            value=store.max_bytes,
        )


def restore_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        "polykv_pool_restore_seconds",
        "A pool created from a KV snapshot: from its prefix ready to resident (lookup, "
        "transfer, checks and load), by where the snapshot came from",
        ["source"],
        buckets=RESTORE_BUCKETS,
        registry=registry,
    )


def build_registry(
    snapshot: Callable[[], EngineSnapshot],
    pool_gauges: Callable[[], list[PoolGauges]],
    autoscale: Callable[[], tuple[float, int, int, int]],
    compute: Callable[[], ComputeThreads | None] = lambda: None,
) -> tuple[CollectorRegistry, Counter]:
    """A registry of its own (tests run several engines in one process)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(snapshot))
    registry.register(CpuCollector(compute))
    registry.register(PoolCollector(pool_gauges))
    registry.register(AutoscaleCollector(autoscale))
    http = Counter(
        "polykv_http_requests",
        "HTTP requests by route template and status code",
        ["route", "code"],
        registry=registry,
    )
    return registry, http
