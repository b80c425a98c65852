"""The admission gate on the request path (asyncio side; never blocks the engine thread).

It reads the engine's published snapshot, keeps each pool's settle/drop state, answers
``/capacity``, and for an enforced policy decides whether a NEW session may attach:
reject (429 + Retry-After), warn (admit + X-Sessions-Remaining), or queue (hold, bounded).
A known session (of the same tenant) is a continuation and is never gated;
``"overcommit": true`` and the router's re-homed marker bypass the gate, but only from the
admin key or the router (``trusted_overrides``): from anyone else they are ignored, logged
once and counted. While the last admit is still settling the attach is held briefly, not
refused: spawns slow down just enough, never fail for settling alone. Held requests count
against the engine's queue bound, as queued ones do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prometheus_client import CollectorRegistry, Counter

from polykv_api.models import AdmissionReason, Capacity, Reason
from polykv_engine.core.engine import Engine
from polykv_engine.core.snapshot import EngineSnapshot, PoolSnapshot, SlotSnapshot
from polykv_engine.core.tasks import GenerateTask
from polykv_engine.http.errors import ApiError
from polykv_engine.http.metrics import PoolCounters
from polykv_engine.policy.admission import (
    REASON_PREFILL,
    REASON_SETTLING,
    RETURN_WINDOW_S,
    EngineView,
    LoadMemory,
    PoolAdmissionState,
    SessionView,
    capacity,
    compaction_pressure,
    retry_after_s,
)
from polykv_engine.policy.autoscale import PoolLoad, RecentDistinct, floor_pressure
from polykv_engine.policy.step_time import CeilingCurve
from polykv_engine.policy.tps import active_rates

log = logging.getLogger("polykv.admission")

# The error reason a refused attach carries, by the admission verdict's code.
GATE_REASONS: dict[AdmissionReason, Reason] = {
    "ok": "tps_floor",
    "guaranteed": "tps_floor",
    "settling": "settling",
    "prefill": "prefill",
    "tps_floor": "tps_floor",
    "kv_headroom": "kv_headroom",
    "context_headroom": "context_headroom",
}

POLL_S = 0.05


def engine_view(
    snap: EngineSnapshot,
    pool: PoolSnapshot | None,
    pause_aware: bool = True,
    ceiling_curve: CeilingCurve = "cycle",
) -> EngineView:
    wall = time.time()  # slots stamp the end of a turn with the wall clock

    def floor(pool_id: int | None) -> float | None:
        attached = snap.pool(pool_id) if pool_id is not None else None
        policy = attached.admission if attached is not None else None
        return policy.target_tps_per_session if policy is not None else None

    sessions = tuple(
        SessionView(
            task_id=s.task_id,
            decoding=s.state == "decoding",
            warming=s.warming and s.processing,
            tps_ewma=s.tps_ewma,
            n_decoded=s.n_decoded,
            in_pool=pool is not None and s.pool_id == pool.pool_id,
            ctx_used=s.ctx_used,
            private_tokens=max(0, s.ctx_used - s.shared_prefix),
            returning=s.processing
            or (s.session_id is not None and wall - s.last_used < RETURN_WINDOW_S),
            floor_tps=floor(s.pool_id),
        )
        for s in snap.slots
    )
    return EngineView(
        sessions=sessions,
        # Idle prompt caches are dropped when a session needs their cells: not used here.
        free_cells=max(0, snap.kv_cells_total - snap.kv_cells_used + snap.kv_cells_reclaimable),
        total_cells=snap.kv_cells_total,
        n_ctx_slot=snap.n_ctx_slot,
        idle_slots=sum(1 for s in snap.slots if not s.processing),
        pool_prefix_len=pool.prefix_len if pool is not None else 0,
        step_curve=snap.step_curve,
        cycle_curve=snap.cycle_curve,
        pause_aware=pause_aware,
        ceiling_curve=ceiling_curve,
        prefill_pending=snap.prefill_pending,
        prefill=snap.prefill,
        n_batch=snap.n_batch,
    )


class AdmissionGate:
    def __init__(self, engine: Engine, registry: CollectorRegistry) -> None:
        self.engine = engine
        self.states: dict[int, PoolAdmissionState] = {}
        self.memory = LoadMemory()  # engine-wide: the last measured mean, for idle moments
        self.pause_aware = engine.cfg.pause_aware_admission
        self.ceiling_curve = engine.cfg.admission_ceiling
        self.counters = PoolCounters(registry)
        # Sessions turned away in the last minute, engine-wide and per pool: demand that a
        # floor-keeping gate hides from the tps figures (autoscaling counts it).
        self.refused = RecentDistinct()
        self.refused_by_pool: dict[str, RecentDistinct] = {}
        self._labels: dict[int, str] = {}  # pool id -> the label its series carry
        self._admitted_to: dict[int, int] = {}  # task id -> pool id, until the request ends
        self._updater: asyncio.Task[None] | None = None
        self.held = 0  # requests this gate holds now (settling, or queued for capacity)
        self.ignored_overrides = Counter(
            "polykv_ignored_overrides",
            "overcommit or x-polykv-rehomed from a key that may not set them (ignored)",
            ["field"],
            registry=registry,
        )
        self._ignored_logged: set[str] = set()

    # ------------------------------------------------------------------ request checks

    def trusted_overrides(
        self, overcommit: bool, rehomed: bool, trusted: bool
    ) -> tuple[bool, bool]:
        """(overcommit, rehomed) as honoured: both only from the admin key or the router;
        from anyone else they are dropped, logged the first time and counted."""
        if trusted:
            return overcommit, rehomed
        for name, asked in (("overcommit", overcommit), ("x-polykv-rehomed", rehomed)):
            if asked:
                self.ignored_overrides.labels(name).inc()
                if name not in self._ignored_logged:
                    self._ignored_logged.add(name)
                    log.warning(
                        "%s ignored: only the admin key or the router may set it (logged "
                        "once; polykv_ignored_overrides_total counts them)",
                        name,
                    )
        return False, False

    def queue_full(self) -> bool:
        """The engine's queue bound, counting the requests held here as well as the ones
        queued in the engine."""
        return self.engine.snapshot.n_waiting + self.held >= self.engine.cfg.max_queue

    def refuse_full_queue(self, task: GenerateTask) -> ApiError:
        self.record_refusal(task, None)
        limit = self.engine.cfg.max_queue
        return ApiError(
            503,
            f"the engine queue is full (max_queue={limit}: requests queued or held for admission)",
            headers={"Retry-After": "2"},
            reason="queue_full",
        )

    def state(self, pool_id: int) -> PoolAdmissionState:
        return self.states.setdefault(pool_id, PoolAdmissionState())

    # ------------------------------------------------------------------ background

    def start(self) -> None:
        self._updater = asyncio.get_running_loop().create_task(self._update_loop())

    async def stop(self) -> None:
        if self._updater is not None:
            self._updater.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._updater

    async def _update_loop(self) -> None:
        while True:
            self.tick(time.monotonic())
            await asyncio.sleep(POLL_S)

    def tick(self, now: float) -> None:
        """Close settle windows promptly and keep the last measured mean current."""
        snap = self.engine.snapshot
        self.memory.observe(self.view(snap, None), now)
        live = {p.pool_id for p in snap.pools}
        for pid in [pid for pid in self.states if pid not in live]:
            del self.states[pid]  # the pool was released
        for pid in [pid for pid in self._labels if pid not in live]:
            label = self._labels.pop(pid)
            self.counters.forget(label)  # its series go with it
            self.refused_by_pool.pop(label, None)
        for pool in snap.pools:
            if pool.admission is None:
                continue
            if self.state(pool.pool_id).update(pool.admission, self.view(snap, pool), now):
                log.debug("pool %s: settled", pool.label)

    # ------------------------------------------------------------------ questions

    def view(self, snap: EngineSnapshot, pool: PoolSnapshot | None) -> EngineView:
        return engine_view(snap, pool, self.pause_aware, self.ceiling_curve)

    def capacity(
        self,
        pool: PoolSnapshot,
        expected_tokens: int | None,
        session_id: str | None,
        tenant: str | None = None,
    ) -> Capacity:
        """``tenant``: whose sessions count as known (None: any tenant's, for the admin)."""
        snap = self.engine.snapshot
        now = time.monotonic()
        st = self.state(pool.pool_id)
        view = self.view(snap, pool)
        if pool.admission is not None:
            st.update(pool.admission, view, now)
        self.memory.observe(view, now)
        known = session_id is not None and any(
            s.session_id == session_id and (tenant is None or s.tenant == tenant)
            for s in snap.slots
        )
        return capacity(pool.admission, st, view, now, expected_tokens, known, self.memory)

    def compaction_pressure(self, pool: PoolSnapshot | None) -> float:
        """0..1: how close the sessions (of ``pool``, or engine-wide) are to the KV wall."""
        snap = self.engine.snapshot
        if pool is not None:
            return self.capacity(pool, None, None).compaction_pressure
        return compaction_pressure(self.view(snap, None))

    async def admit(
        self, task: GenerateTask, overcommit: bool, rehomed: bool = False
    ) -> dict[str, str]:
        """Gate a request that attaches to a pool. Returns headers to add; raises 429.

        ``rehomed``: a router moved a running session here after its replica went away; it
        is a continuation the fleet already admitted, so it is never gated."""
        if task.pool_ref is None:
            return {}
        pool = self.engine.snapshot.pool(task.pool_ref)
        if pool is None or pool.admission is None:
            return {}  # unknown pools fail in the engine with 404; no policy, no gate
        policy = pool.admission
        snap = self.engine.snapshot
        if task.session_id is not None and any(
            s.session_id == task.session_id and s.tenant == task.tenant for s in snap.slots
        ):
            return {}  # continuation (of this tenant's session): never gated
        if rehomed:
            log.info("pool %s: re-homed session %s admitted ungated", pool.label, task.session_id)
            self.counters.rehomes.labels(pool.label).inc()
            return {}
        if overcommit:
            log.warning("pool %s: overcommit requested, gate bypassed", pool.label)
            self.counters.overcommits.labels(pool.label).inc()
            self._record(pool, task)
            return {}
        cap = self.capacity(pool, None, None)
        enforced = policy.mode == "enforced"
        if enforced and cap.reason in (REASON_SETTLING, REASON_PREFILL):
            # Slow the spawn just enough: wait for the settle, or for the prompts in
            # progress to go in, then decide.
            cap = await self._hold(task, pool, (policy.settle_max_ms + 1000) / 1e3, True)
        if enforced and not cap.can_admit and policy.on_saturation == "queue":
            cap = await self._hold(task, pool, policy.queue_max_ms / 1e3, False)
        headers: dict[str, str] = {}
        if enforced and not cap.can_admit:
            if policy.on_saturation == "warn":
                headers["X-Sessions-Remaining"] = str(cap.headroom_sessions)
            else:
                self.counters.reject(pool.label, cap.reason_code)
                self.record_refusal(task, pool.label)
                raise ApiError(
                    429,
                    f"pool {pool.label!r} cannot admit a new session: {cap.reason}",
                    "rate_limit_error",
                    reason=GATE_REASONS[cap.reason_code],
                    headers={"Retry-After": str(retry_after_s(cap, policy))},
                    extra={"pool": pool.label},
                )
        elif enforced and policy.on_saturation == "warn":
            headers["X-Sessions-Remaining"] = str(max(0, cap.headroom_sessions - 1))
        self._record(pool, task)
        return headers

    def record_refusal(self, task: GenerateTask, pool: str | None) -> None:
        """A session was turned away (gate 429, or a full queue)."""
        key = task.session_id or f"request-{task.task_id}"
        now = time.monotonic()
        self.refused.add(key, now)
        if pool is not None:
            self.refused_by_pool.setdefault(pool, RecentDistinct()).add(key, now)

    def refused_recently(self, pool: str) -> int:
        tracker = self.refused_by_pool.get(pool)
        return tracker.count(time.monotonic()) if tracker is not None else 0

    def autoscale(self) -> tuple[float, int, int, int]:
        """(floor pressure, active sessions, refused in the last minute, headroom)."""
        snap = self.engine.snapshot
        now = time.monotonic()
        by_pool: dict[int, list[SlotSnapshot]] = {}
        for s in snap.slots:
            if s.pool_id is not None:
                by_pool.setdefault(s.pool_id, []).append(s)
        loads = []
        for pool in snap.pools:
            members = by_pool.get(pool.pool_id, [])
            rates = active_rates((s.state == "decoding", s.warming, s.tps_ewma) for s in members)
            floor = pool.admission.target_tps_per_session if pool.admission else None
            loads.append(PoolLoad(floor, rates.n_active, rates.tps_sum))
        view = self.view(snap, None)
        headroom = capacity(None, PoolAdmissionState(), view, now).headroom_sessions
        return floor_pressure(loads), snap.n_processing, self.refused.count(now), headroom

    def finished(self, task: GenerateTask) -> None:
        """The request ended: count the query, and a prefix hit when it reused the pool's
        cells."""
        admitted_to = self._admitted_to.pop(task.task_id, None)
        if admitted_to is not None and admitted_to in self.states:
            self.states[admitted_to].forget(task.task_id)
        if task.pool is not None:
            self._labels[task.pool.pool_id] = task.pool.label
            self.counters.queries.labels(task.pool.label).inc()
            if task.shared_prefix > 0:
                self.counters.prefix_hits.labels(task.pool.label).inc()

    def _record(self, pool: PoolSnapshot, task: GenerateTask) -> None:
        self._labels[pool.pool_id] = pool.label
        self.counters.admits.labels(pool.label).inc()
        self.state(pool.pool_id).record_admit(task.task_id, time.monotonic())
        self._admitted_to[task.task_id] = pool.pool_id

    async def _hold(
        self, task: GenerateTask, pool: PoolSnapshot, limit_s: float, transient: bool
    ) -> Capacity:
        """Hold the request (a place in the queue bound) until it may go, or refuse it
        (503 queue_full) when the bound is already taken."""
        if self.queue_full():
            raise self.refuse_full_queue(task)
        self.counters.holds.labels(pool.label).inc()
        self.held += 1
        try:
            return await self._wait(pool, limit_s, transient)
        finally:
            self.held -= 1

    async def _wait(self, pool: PoolSnapshot, limit_s: float, transient: bool) -> Capacity:
        deadline = time.monotonic() + limit_s
        while True:
            current = self.engine.snapshot.pool(pool.pool_id) or pool
            cap = self.capacity(current, None, None)
            passing = cap.settling or cap.reason == REASON_PREFILL
            done = not passing if transient else cap.can_admit
            if done or time.monotonic() >= deadline:
                return cap
            await asyncio.sleep(POLL_S)
