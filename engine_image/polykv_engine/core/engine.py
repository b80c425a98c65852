"""The engine thread: it alone owns the llama context, the KV cache and the slot table.

HTTP handlers talk to it only through ``submit`` / ``cancel`` / ``call`` (thread-safe inbox)
and read the published ``snapshot``. Each iteration of the loop is one step:

    drain inbox -> assign waiting requests to slots -> build ONE batch -> llama_decode -> update

``core.scheduler`` decides what goes into the batch (a token for every decoding slot,
then prompt chunks, then pool builds: continuous batching) and what to shed when the KV
cache is full; ``core.slots`` keeps the slot table. Requests beyond the slot count wait in
FIFO order; none is dropped.

Sequence-id layout: slots use ids ``0..n_parallel-1``; pools use
``n_parallel..n_parallel+max_pools-1``; with ``kv_debug`` one more id is a probe.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from polykv_api.limits import MAX_GRAMMAR_STACKS
from polykv_api.models import Reason
from polykv_engine.core import session_snapshots
from polykv_engine.core.assembly import assemble
from polykv_engine.core.config import EngineConfig
from polykv_engine.core.draft_model import DraftModel, DraftRequest
from polykv_engine.core.prefix import AttachedPool, waits_for_shared_prefix
from polykv_engine.core.scheduler import (
    ActiveSlot,
    Shed,
    ShedView,
    build_batch,
    choose_slot,
    may_name,
    pick_shed,
)
from polykv_engine.core.slots import Slot, SlotTable
from polykv_engine.core.snapshot import Counters, EngineSnapshot, PublishedPools
from polykv_engine.core.tasks import (
    DoneEvent,
    ErrorEvent,
    GenerateTask,
    StopType,
    TokenEvent,
)
from polykv_engine.kv.cache import KVCache
from polykv_engine.kv.memory import Memory
from polykv_engine.llama.runtime import Batch, LlamaError, LlamaRuntime
from polykv_engine.persist.fileformat import KVSnapshot, SnapshotRefused
from polykv_engine.persist.store import SnapshotStore
from polykv_engine.policy.prefill import PrefillPacer
from polykv_engine.policy.speculation import Speculation
from polykv_engine.policy.step_time import (
    CYCLE_ALPHA,
    CYCLE_FRESH_S,
    CYCLE_MIN_STEPS,
    StepTimer,
)
from polykv_engine.policy.tps import ThroughputRate
from polykv_engine.pools.manager import PoolManager
from polykv_engine.pools.tree import PoolError
from polykv_engine.tokens import common_prefix_len

log = logging.getLogger("polykv.engine")

# While sessions decode, the snapshot (every slot and pool, copied) is published at most this
# often instead of after every step: at 240 pools it was 3.8% of a one-stream step. A
# finished request, a control call, a slot changing phase and the engine going idle still
# publish at once; only rates and counts wait.
PUBLISH_EVERY_S = 0.01

T = TypeVar("T")

# How long a step may wait for requests that arrive together: the server reads a burst one
# request at a time (about a millisecond each on a busy CPU).
ARRIVAL_GATHER_S = 0.02


class Engine:
    """Owns the engine thread. Construct, ``start()``, then submit tasks."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="polykv-engine", daemon=True)
        self._ready = threading.Event()
        self.load_error: BaseException | None = None
        self.runtime: LlamaRuntime | None = None
        self.snapshot = EngineSnapshot(ts=time.time(), ready=False)
        self._waiting: deque[GenerateTask] = deque()
        self._decode_rate = ThroughputRate(cfg.tps_window_s)
        self._prefill_rate = ThroughputRate(cfg.tps_window_s)
        self._step_timer = StepTimer()
        self._pacer = PrefillPacer(cfg.prefill_budget, cfg.prefill_floor_tps)
        # Every step with sessions decoding, start to next start (prompt chunks and loop time
        # included): the time between two tokens of a decoding session, by the number of
        # sessions in the batch (decoding or prefilling their turn).
        self._cycle_timer = StepTimer(
            alpha=CYCLE_ALPHA, min_steps=CYCLE_MIN_STEPS, fresh_s=CYCLE_FRESH_S
        )
        self._cycle_from: tuple[int, float] | None = None  # (sessions in the batch, start)
        self._paced_end: float | None = None  # when the last step that paced a prompt ended
        self._counters = Counters()
        self._deltas: dict[str, float] = {}  # bumps since the last publish, applied there
        self._batch: Batch | None = None
        self._stop_requested = False
        self._kv: KVCache | None = None
        self._answers: list[tuple[GenerateTask, DoneEvent]] = []
        """Finished requests, answered right after the snapshot that shows them is out."""
        self._published_at = 0.0
        self._published_phases: tuple[tuple[str, bool], ...] = ()
        self._published_pools = PublishedPools()
        self._pools: PoolManager | None = None
        self._slots: SlotTable | None = None
        self.snapshots: SnapshotStore | None = None  # set at load when --polykv-snapshot-dir
        self.pools_disabled_reason: str | None = None
        self.memory = Memory("attention")  # the model's, once loaded
        self._drafter: DraftModel | None = None  # -md: speculative drafts from a small model
        self.swa_full_cost = 0  # bytes the full-size SWA cache adds (pools on an SWA model)
        self._arrived = False  # a request was queued since the last arrival barrier
        self.arrival_barrier: Callable[[float], None] | None = None
        """Set by the server before ``start()``. Called on the engine thread when requests
        arrived, with a time limit; returns once requests read beside them were submitted (a
        burst of agents is read one request at a time on the server's loop), so their prompts
        go into one step: otherwise the first is prefilled alone and the others, one step
        later, wait for it, while it waits for theirs before its second token."""

    # ------------------------------------------------------------------ any thread

    @property
    def _parks(self) -> bool:
        """Whether idle caches are parked (unified cache only: a split cache gives each slot
        its own cells, which no other slot's decode reads)."""
        cfg = self.cfg
        alone = cfg.n_parallel == 1 and cfg.max_pools == 0  # nothing else ever computes
        return cfg.park_mib > 0 and cfg.runtime.kv_unified and not alone

    @property
    def _scratch_seq(self) -> int | None:
        """The spare sequence id that parking and pool snapshots save and load cells
        through (None: neither is on)."""
        cfg = self.cfg
        return cfg.n_parallel + cfg.max_pools if self._parks or cfg.snapshots_on else None

    @property
    def n_seq_max(self) -> int:
        spare = (self._scratch_seq is not None) + self.cfg.kv_debug
        return self.cfg.n_parallel + self.cfg.max_pools + spare

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.runtime is not None and self.snapshot.ready

    @property
    def ready(self) -> bool:
        return self.snapshot.ready

    def submit(self, task: GenerateTask) -> None:
        task.submitted_at = time.perf_counter()
        self._inbox.put(("submit", task))

    def cancel(self, task_id: int) -> None:
        self._inbox.put(("cancel", task_id))

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps; the future has its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    def stop(self, timeout: float | None = None) -> None:
        """Stop the engine thread; by default wait as long as writing sessions' caches may
        take, and then some for freeing the model."""
        self._inbox.put(("stop", None))
        self._thread.join(self.cfg.session_save_s + 10.0 if timeout is None else timeout)

    # ------------------------------------------------------------------ engine thread only

    @property
    def rt(self) -> LlamaRuntime:
        assert self.runtime is not None
        return self.runtime

    @property
    def pools(self) -> PoolManager:
        assert self._pools is not None
        return self._pools

    @property
    def slots(self) -> SlotTable:
        assert self._slots is not None
        return self._slots

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:  # reported through /health; the server exits
            self.load_error = exc
            log.error("engine failed to start: %s", exc)
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop_requested:
                idle = not self._has_work()
                if idle:
                    self._cycle_from = None  # an idle wait is no session's step time
                    self._paced_end = None
                self._drain_inbox(block=idle)
                self._gather_arrivals()
                if self._stop_requested:
                    break
                t0 = time.perf_counter()
                self._assign_waiting()
                busy = self._busy()
                if busy:
                    self._step()
                    self._bump(busy_seconds=time.perf_counter() - t0)
                    busy = self._busy()
                if (
                    self._answers
                    or not busy
                    or t0 - self._published_at >= PUBLISH_EVERY_S
                    or self._phases() != self._published_phases
                ):
                    self._publish()
        except BaseException:
            log.exception("engine loop crashed")
            raise
        finally:
            self._shutdown()

    def _load(self) -> None:
        parts = assemble(self.cfg, self.n_seq_max, self._scratch_seq, self._parks)
        self.runtime = parts.runtime
        self.memory = parts.memory
        self.snapshots = parts.snapshots
        self._drafter = parts.drafter
        self._batch = parts.batch
        self._kv = parts.kv
        self._slots = parts.slots
        self._pools = parts.pools
        self.pools_disabled_reason = parts.pools_disabled_reason
        self.swa_full_cost = parts.swa_full_cost
        self._publish(ready=True)

    def _busy(self) -> bool:
        builds = self._pools is not None and bool(self._pools.builds)
        return builds or any(s.state != "idle" for s in self.slots.slots)

    def _has_work(self) -> bool:
        return bool(self._waiting) or self._busy()

    def _gather_arrivals(self) -> None:
        """While requests keep arriving, let the server hand over the ones it is reading."""
        if self.arrival_barrier is None:
            return
        deadline = time.monotonic() + ARRIVAL_GATHER_S
        while self._arrived and not self._stop_requested:
            self._arrived = False
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.arrival_barrier(left)
            self._drain_inbox(block=False)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        if kind == "submit":
            self._accept(payload)
        elif kind == "cancel":
            self._cancel(payload)
        elif kind == "call":
            fn, fut = payload
            self._flush_streams()  # a control call may take a while (a pool snapshot, a build)
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(self)
                except BaseException as exc:
                    fut.set_exception(exc)
                else:
                    # Publish before answering: a caller that reads the snapshot next (a
                    # capacity query right after setting a policy) sees its own change.
                    self._publish()
                    fut.set_result(result)
        elif kind == "stop":
            self._stop_requested = True

    def _accept(self, task: GenerateTask) -> None:
        """Queue a request, unless the queue is full or its session already runs a turn."""
        if len(self._waiting) >= self.cfg.max_queue:
            msg = f"the engine queue is full ({self.cfg.max_queue} requests wait for a slot)"
            self._fail(task, 503, "unavailable_error", "queue_full", msg, retry_after=2)
            return
        sid, tenant = task.session_id, task.tenant
        if sid is not None and (
            any(
                s.session_id == sid and s.tenant == tenant and s.state != "idle"
                for s in self.slots.slots
            )
            or any(w.session_id == sid and w.tenant == tenant for w in self._waiting)
        ):
            msg = f"session {sid!r} already has a request running; send turns one at a time"
            self._fail(task, 409, "conflict_error", "session_busy", msg, retry_after=1)
            return
        self._waiting.append(task)
        self._arrived = True

    def _cancel(self, task_id: int) -> None:
        for task in list(self._waiting):
            if task.task_id == task_id:
                self._waiting.remove(task)
                self._bump(requests_cancelled=1)
                return
        for slot in self.slots.slots:
            if slot.task is not None and slot.task.task_id == task_id:
                log.info("slot %d: request %d cancelled by the client", slot.slot_id, task_id)
                self.slots.release(slot)
                self._bump(requests_cancelled=1)
                return

    # ------------------------------------------------------------------ admission to slots

    def _assign_waiting(self) -> None:
        if not self._waiting:
            return
        still: deque[GenerateTask] = deque()
        table = self.slots
        views = [s.view() for s in table.slots]
        while self._waiting:
            task = self._waiting.popleft()
            if task.id_slot >= len(table):
                msg = f"id_slot {task.id_slot} does not exist"
                self._fail(task, 400, "invalid_request_error", "slot_not_found", msg)
                continue
            try:
                if task.pool_ref is not None and not self._pool_ready_for(task):
                    still.append(task)  # waits while its pool (re-)materializes
                    continue
            except PoolError as exc:
                self._fail_pool(task, exc, "invalid_request_error")
                continue
            if self._waits_for_a_shared_prefix(task):
                still.append(task)
                continue
            session_slot = table.slot_of(task.tenant, task.session_id)
            named = task.id_slot if session_slot is None else -1  # a session's slot wins
            if named >= 0 and not may_name(views[named], task.tenant):
                msg = (
                    f"id_slot {named} holds another key's session or cache; name a free slot "
                    "or one of your own, or leave id_slot out"
                )
                self._fail(task, 409, "conflict_error", "slot_busy", msg)
                continue
            chosen = choose_slot(
                views, task.prompt, session_slot, task.id_slot, task.cache_prompt, task.tenant
            )
            if chosen is None:
                still.append(task)
                continue
            self._begin(table[chosen], task)
            views[chosen] = table[chosen].view()
        self._waiting = still

    def _pool_ready_for(self, task: GenerateTask) -> bool:
        """Resolve the task's pool; False while it is (re-)materializing. Raises PoolError."""
        assert task.pool_ref is not None
        if self.pools_disabled_reason:
            raise PoolError(
                501, "pools_disabled", self.pools_disabled_reason, "not_supported_error"
            )
        try:
            pool = self.pools.tree.resolve(task.pool_ref, task.tenant)
        except PoolError:
            if not task.pool_kept:
                raise
            task.pool_ref = None  # the kept prefix went (TTL, KV pressure): compute it
            return True
        if pool.residency != "resident":
            try:
                fut = self.pools.ensure_resident(pool)
            except PoolError as exc:
                if exc.reason != "seq_ids_exhausted":
                    raise
                # No sequence id to re-materialize the evicted pool into: serve the request
                # without it (full prefill, same output) rather than fail the user's turn.
                log.warning("pool %s: attach falls back to a full prefill: %s", pool.label, exc)
                task.pool_fallback = exc.message
                return True
            if fut.done() and fut.exception() is not None:
                failure = fut.exception()
                if isinstance(failure, PoolError):
                    raise failure
                raise PoolError(500, "internal", str(failure), "server_error")
            return False
        task.pool = pool
        return True

    def _begin(self, slot: Slot, task: GenerateTask) -> None:
        now = time.perf_counter()
        self.slots.park_due = True  # others may now be worth parking
        if slot.tenant is not None and slot.tenant != task.tenant:
            # Another tenant's cache: never reused (what it holds would show in cache_n and
            # in the prefill time), so it goes before anything is attached or kept.
            self.slots.forget_kv(slot)
        if task.restore is not None:
            self._restore_session(slot, task, task.restore)
            task.restore = None
        restored = self.slots.unpark(slot, task.prompt if task.cache_prompt else [])
        self._bump(kv_unparked_tokens=restored)
        pool = task.pool
        share = task.cache_prompt and self._auto_share
        try:
            plan = self.slots.plan_prefix(slot, task, self._attached(task), share)
        except PoolError as exc:
            self._fail_pool(task, exc, "conflict_error")
            return
        if pool is not None:
            pool.last_access_ts = time.time()
        same_session = (
            task.session_id is not None
            and slot.session_id == task.session_id
            and slot.tenant == task.tenant
        )
        task.prev_tps = slot.rate.tps if same_session else 0.0
        task.slot_id = slot.slot_id
        self.slots.bind(slot, task.tenant, task.session_id)
        self.slots.apply_prefix(slot, plan, task.prompt)
        if plan.auto_shared > 0:
            self._bump(auto_shared_tokens=plan.auto_shared)
        keep = plan.reuse
        before = self.pools.tree.pools.get(slot.pool_id) if slot.pool_id is not None else None
        shared = self.slots.link_pool(slot, pool if pool is not None else before)
        if pool is not None and pool.seq_id is not None:
            task.shared_prefix = shared
        slot.shared_prefix = task.shared_prefix if slot.pool_id is not None else 0
        sampling = task.sampling.resolved()
        # ignore_eos bans end-of-generation tokens, except under a grammar: a finished
        # grammar admits nothing else, and a token it refuses would abort llama.cpp.
        ban_eog = task.stop.ignore_eos and task.grammar is None
        slot.sampler = self.rt.new_sampler(sampling, task.grammar, ban_eog)
        task.grammar = None  # the chain owns it now
        if sampling.has_penalties:
            n = sampling.repeat_last_n
            for tok in task.prompt[-n:] if n > 0 else task.prompt:
                slot.sampler.accept_prompt(tok)
        slot.start(task, sampling, keep, now)
        slot.spec = self._speculation(task)
        log.debug(
            "slot %d: request %d (session %s) prompt=%d cached=%d pool=%s",
            slot.slot_id,
            task.task_id,
            task.session_id,
            len(task.prompt),
            keep,
            task.pool.label if task.pool else None,
        )

    def _restore_session(self, slot: Slot, task: GenerateTask, snap: KVSnapshot) -> None:
        """Load the session's cache saved by an earlier process (``core.session_snapshots``)
        into ``slot``, when it gives the prompt more than the slot's own cache would. A
        refusal is logged and counted: the turn is prefilled."""
        store, scratch = self.snapshots, self._scratch_seq
        assert store is not None and scratch is not None and snap.tokens is not None
        store.discard(snap.key)  # used or not, it is this session's past: never read again
        own = common_prefix_len(slot.cached, task.prompt) if slot.tenant == task.tenant else 0
        if common_prefix_len(snap.tokens, task.prompt) <= max(own, snap.start):
            store.session_counted(restored="unused")
            return
        t0 = time.perf_counter()
        try:
            pool = session_snapshots.restore(
                self.slots, self.pools.tree, slot, scratch, snap, task.tenant
            )
        except SnapshotRefused as exc:
            store.refused(exc.reason)
            store.session_counted(restored="refused")
            log.warning(
                "slot %d: session cache not restored (%s): %s; prefilling the turn",
                slot.slot_id,
                exc.reason,
                exc.message,
            )
            return
        slot.pool_id = pool.pool_id if pool is not None else None
        store.session_counted(restored="restored")
        shared = f"{snap.start} shared with pool {pool.label}" if pool is not None else "whole"
        log.info(
            "slot %d: session cache restored: %d positions (%s) in %.1f ms",
            slot.slot_id,
            snap.end,
            shared,
            (time.perf_counter() - t0) * 1e3,
        )

    @property
    def _auto_share(self) -> bool:
        """Sharing cells between sequences needs one unified KV cache (a split cache gives
        every slot its own cells), and memory that can be cut at any position: not a
        recurrent state. On a sliding window it takes cells where they are still whole
        (``core.prefix``), and only in a full-size window cache: cells two sequences hold
        are never handed out, which a window-sized cache could run out of."""
        cfg, mem = self.rt.cfg, self.memory
        windowed = mem.kind == "sliding_window" and not cfg.swa_full
        return self.cfg.auto_share and cfg.kv_unified and not mem.exact_length and not windowed

    def _attached(self, task: GenerateTask) -> AttachedPool | None:
        """The task's pool as prefix reuse sees it: only a resident pool has cells."""
        pool = task.pool
        if pool is None or pool.residency != "resident" or pool.seq_id is None:
            return None
        return AttachedPool(pool.seq_id, pool.tokens, pool.label, task.pool_p)

    def _waits_for_a_shared_prefix(self, task: GenerateTask) -> bool:
        """A prompt whose long prefix another slot is prefilling right now waits for it
        (``core.prefix.waits_for_shared_prefix``)."""
        if not task.cache_prompt or not self._auto_share:
            return False
        prefilling = self.slots.prefilling(task.tenant)
        if not prefilling:
            return False
        residents = self.slots.residents(task.tenant, pool=self._attached(task))
        pool_tokens = task.pool.tokens if task.pool is not None else None
        own = self.slots.cached_of(task.tenant, task.session_id)
        return waits_for_shared_prefix(task.prompt, prefilling, residents, own, pool_tokens)

    # ------------------------------------------------------------------ one step

    def _step(self) -> None:
        t0 = time.perf_counter()
        if self._cycle_from is not None:
            self._cycle_timer.record(self._cycle_from[0], t0 - self._cycle_from[1], t0)
            self._cycle_from = None
        if self._paced_end is not None:
            self._pacer.record_loop(t0 - self._paced_end)
            self._paced_end = None
        batch = self._batch
        assert batch is not None
        if self.slots.park_due:  # before the batch: new cells may then land low in the cache
            self._flush_streams()
            parked = self.slots.park_idle()
            self._bump(
                kv_parked_tokens=parked.parked_tokens, kv_park_dropped_tokens=parked.dropped_tokens
            )
        self._propose_drafts()
        prompt_budget, t_dec = self._prompt_budget()
        retried = False
        while True:
            build_batch(batch, self.slots.slots, self.pools, prompt_budget)
            if batch.n == 0:
                self.pools.after_decode()  # builds with nothing to prefill (L == D) finish
                return
            if batch.n > sum(1 for s in self.slots.slots if s.state == "decoding"):
                self._flush_streams()  # a prompt or pool chunk: a long step
            td = time.perf_counter()
            try:
                rc = self.rt.decode(batch)
            except LlamaError as exc:
                self._abort_batch(str(exc))
                return
            busy = sum(1 for s in self.slots.slots if s.batch_tokens)
            self._bump(
                decode_calls=1,
                decode_seconds=time.perf_counter() - td,
                busy_slot_steps=busy,
                slot_decode_calls=1 if busy else 0,
            )
            if rc == 0:
                break
            drafted = [s for s in self.slots.slots if s.draft]
            for slot in drafted:  # guesses go before anything that holds cells is shed
                slot.draft = []
            if not drafted and not self._make_room():
                return
            retried = True
        # A step that only decoded (one token for each of b sessions, and what speculation
        # drafted for them) measures t(b), what admission scales rates with; steps carrying
        # prompt or pool chunks do not.
        in_batch = [s for s in self.slots.slots if s.state == "decoding" and s.batch_tokens]
        decoding = len(in_batch)
        decode_tokens = sum(s.batch_tokens for s in in_batch)
        self._after_decode(time.perf_counter())
        seconds = time.perf_counter() - t0
        self._bump(step_seconds=seconds)
        if not retried and decode_tokens == batch.n:
            self._step_timer.record(decoding, seconds)
        elif not retried:
            self._pacer.record(batch.n - decode_tokens, seconds, t_dec if decoding else None)
            if decoding:
                self._paced_end = time.perf_counter()
        if decoding:
            # Keyed by every session in the batch, not the decoding ones only: a step that
            # carries another session's prompt is that session's cost, and admission asks
            # for the rate when all R + 1 sessions run their turns, prompts included.
            self._cycle_from = (busy, t0)

    def _speculation(self, task: GenerateTask) -> Speculation | None:
        """The turn's speculative decoding, when the request (or the engine) asks for it and
        the model's memory can drop a rejected guess: a recurrent state cannot go back, and a
        sliding window (not --swa-full) may recycle cells the guess pushed out of it."""
        params = task.spec or self.cfg.spec
        mem = self.memory
        windowed = mem.kind == "sliding_window" and not self.rt.cfg.swa_full
        if params.type == "none" or params.n_max <= 0 or windowed or mem.exact_length:
            return None
        if params.type == "draft" and self._drafter is None:
            return None
        spec = Speculation(params.n_max, params.n_min, model=params.type == "draft")
        if not spec.model:
            spec.index.extend(task.prompt)
        return spec

    def _propose_drafts(self) -> None:
        """Guess the next tokens of every speculating session, within what its request and
        its context still allow (the guess and the token after it need positions)."""
        asks: list[DraftRequest] = []
        for slot in self.slots.slots:
            slot.draft = []
            spec, task = slot.spec, slot.task
            if spec is None or task is None or slot.state != "decoding" or slot.pending is None:
                continue
            room = slot.n_ctx - slot.n_past - 2
            if task.stop.n_predict >= 0:
                room = min(room, task.stop.n_predict - len(slot.generated) - 1)
            if not spec.model:
                slot.draft = spec.propose(room)
            elif n := spec.length(room):
                asks.append(DraftRequest(slot.slot_id, [*slot.cache_tokens, slot.pending], n))
        if asks and self._drafter is not None:
            for seq, draft in self._drafter.propose(asks).items():
                slot = self.slots[seq]
                assert slot.spec is not None
                slot.draft = slot.spec.worth(draft)

    def _prompt_budget(self) -> tuple[int | None, float | None]:
        """Prompt and pool tokens this step may carry beside the decoding sessions (None: as
        many as fit), and how long their decode-only step takes (``policy.prefill``)."""
        decoding = [s for s in self.slots.slots if s.state == "decoding" and s.pending is not None]
        if not decoding or not (self.pools.builds or self.slots.prefilling_any()):
            return None, None
        t_dec = self.snapshot.step_curve.time_at(len(decoding))
        period = self._pacer.period_s(self._floor_tps(s) for s in decoding)
        capacity = self.rt.n_batch - sum(1 + len(s.draft) for s in decoding)
        budget = self._pacer.budget(period, t_dec, capacity)
        if budget < min(capacity, self.slots.prompt_left() + self.pools.pending_tokens()):
            self._bump(prefill_paced_steps=1)
        return budget, t_dec

    def _floor_tps(self, slot: Slot) -> float | None:
        """The floor of the pool the slot is attached to, if it has one."""
        pool = self.pools.tree.pools.get(slot.pool_id) if slot.pool_id is not None else None
        policy = pool.admission if pool is not None else None
        return policy.target_tps_per_session if policy is not None else None

    def _flush_streams(self) -> None:
        """Tokens that sinks hold back leave now, before the engine thread is busy a while."""
        for slot in self.slots.slots:
            if slot.task is not None:
                slot.task.sink.flush()

    def _abort_batch(self, reason: str) -> None:
        """A decode failed hard: fail every request and build in the batch, forget their KV."""
        in_batch = [s for s in self.slots.slots if s.batch_tokens and s.task is not None]
        log.error("llama_decode failed: %s; failing %d request(s)", reason, len(in_batch))
        msg = f"decode failed: {reason}"
        for slot in in_batch:
            self._fail_slot(slot, 500, "server_error", "decode_failed", msg)
            self.slots.forget_kv(slot)
        for build in self.pools.builds_in_batch():
            self.pools.fail_build(build, PoolError(500, "decode_failed", msg, "server_error"))

    def _shed_view(self) -> ShedView:
        slots = self.slots.slots
        snaps = self.slots.snapshots()
        return ShedView(
            idle_caches=self.slots.droppable_caches(),
            reclaimable_pools=[p.pool_id for p in self.pools.reclaimable(snaps, time.time())],
            builds_in_batch=[b.pool.pool_id for b in self.pools.builds_in_batch()],
            active=[
                ActiveSlot(s.slot_id, s.state == "prefill", s.t_start)
                for s in slots
                if s.state != "idle"
            ],
        )

    def _make_room(self) -> bool:
        """llama_decode found no free KV cells: shed what ``pick_shed`` says; True to retry."""
        self._bump(kv_full_events=1)
        shed = pick_shed(self._shed_view())
        if shed is None:
            return False
        self._apply_shed(shed)
        return shed.action not in ("reject_prompt", "stop_session") or self._busy()

    def _apply_shed(self, shed: Shed) -> None:
        if shed.action == "drop_cache":
            slot = self.slots[shed.target]
            log.info("KV cache full: dropping idle slot %d's prompt cache", slot.slot_id)
            self.slots.forget_kv(slot)
        elif shed.action == "evict_pool":
            pool = self.pools.tree.pools[shed.target]
            log.info("KV cache full: evicting idle pool %s", pool.label)
            self.pools.evict(pool, self.slots.snapshots())
        elif shed.action == "fail_build":
            build = next(b for b in self.pools.builds if b.pool.pool_id == shed.target)
            msg = "KV cache full while materializing the pool; release pools or retry later"
            self.pools.fail_build(build, PoolError(503, "kv_full", msg, "unavailable_error"))
        elif shed.action == "defer_prompt":
            msg = "KV cache full: retry when sessions finish"
            self._fail_slot(self.slots[shed.target], 503, "unavailable_error", "kv_full", msg)
        elif shed.action == "reject_prompt":
            msg = "the prompt does not fit in the free KV cache"
            slot = self.slots[shed.target]
            self._fail_slot(slot, 400, "exceed_context_size_error", "prompt_too_long", msg)
        else:
            log.warning("KV cache full: stopping slot %d early", shed.target)
            self._finish(self.slots[shed.target], "limit", truncated=True)

    def _after_decode(self, now: float) -> None:
        n_decoded = 0
        n_prefilled = 0
        for slot in self.slots.slots:
            if slot.batch_tokens == 0:
                continue
            if slot.state == "prefill":
                start = slot.n_prompt_done
                self.slots.decoded(slot, slot.prompt[start : start + slot.batch_tokens])
                slot.n_prompt_done += slot.batch_tokens
                n_prefilled += slot.batch_tokens
                if slot.logits_idx < 0:
                    continue
                slot.t_first = now
                slot.ttft_ms = (now - slot.t_start) * 1e3
                slot.state = "decoding"
                self._bump(
                    prompt_tokens=len(slot.prompt) - slot.n_cached,
                    prompt_seconds=now - slot.t_start,
                    cache_tokens=slot.n_cached,
                )
            else:
                assert slot.pending is not None
                self.slots.decoded(slot, (slot.pending, *slot.draft))
                slot.pending = None
                n_decoded += 1 + self._sample(slot, now)
                continue
            self._sample(slot, now)
        n_prefilled += self.pools.after_decode()
        self._bump(decoded_tokens=n_decoded, prefilled_tokens=n_prefilled)
        if n_decoded:
            self._decode_rate.add(n_decoded, now)
        if n_prefilled:
            self._prefill_rate.add(n_prefilled, now)

    def _sample(self, slot: Slot, now: float) -> int:
        """Sample the slot's next token, and after it one for each drafted token the sampler
        picked itself, so a draft never changes what is generated; returns the drafted tokens
        kept (their cells stay, the rest are dropped)."""
        task = slot.task
        assert task is not None and slot.sampler is not None
        if task.stop.n_predict == 0:
            self._finish(slot, "limit")  # prompt processing only (e.g. to warm a cache)
            return 0
        draft = slot.draft
        picks: list[tuple[int, int]] = []  # (token, the batch index of its logits)
        for i in range(len(draft) + 1):
            idx = slot.logits_idx if i == 0 else slot.draft_idx + i - 1
            tok = slot.sampler.sample(self.rt.ctx, idx)
            stacks = slot.sampler.grammar_stacks()
            if stacks > MAX_GRAMMAR_STACKS:  # an ambiguous grammar: they can double every token
                self.slots.truncate(slot, slot.n_past - len(draft))
                msg = (
                    f"grammar: {stacks} parse stacks after {len(slot.generated) + i + 1} "
                    f"tokens, the limit is {MAX_GRAMMAR_STACKS} (alternatives that match the "
                    "same text)"
                )
                self._fail_slot(slot, 400, "invalid_request_error", "grammar_too_large", msg)
                return 0
            picks.append((tok, idx))
            if i == len(draft) or tok != draft[i]:
                break
        kept = len(picks) - 1
        if draft:
            assert slot.spec is not None
            self.slots.truncate(slot, slot.n_past - (len(draft) - kept))
            slot.spec.verified(len(draft), kept)
            self._bump(spec_draft_tokens=len(draft), spec_accepted_tokens=kept)
            slot.draft = []
        for tok, idx in picks:
            if not self._emit(slot, task, tok, idx, now):
                return kept
        slot.pending = picks[-1][0]
        if slot.n_past >= slot.n_ctx:
            # The pending token has no position left in this slot's context.
            if self.cfg.context_shift and self._can_shift(slot):
                self._shift_context(slot)
            else:
                self._finish(slot, "limit", truncated=True)
        return kept

    def _emit(self, slot: Slot, task: GenerateTask, tok: int, idx: int, now: float) -> bool:
        """One generated token to the client; False when it ended the turn."""
        slot.rate.on_token(now)
        stop = task.stop
        slot.generated.append(tok)
        if slot.spec is not None:
            slot.spec.index.extend((tok,))
        if self.rt.is_eog(tok) and not stop.ignore_eos:
            self._finish(slot, "eos")
            return False
        probs = None
        if task.logprobs is not None:  # from the logits the sampler just used
            probs = self.rt.token_logprobs(idx, tok, task.logprobs)
        text = slot.assembler.push(self.rt.token_bytes(tok, tok in task.preserved_tokens))
        if text or not slot.assembler.stops or probs is not None:
            task.sink.emit(TokenEvent(text, tok, probs))
        if slot.assembler.stopping_word is not None:
            self._finish(slot, "word")
            return False
        if 0 <= stop.n_predict <= len(slot.generated):
            self._finish(slot, "limit")
            return False
        return True

    def _can_shift(self, slot: Slot) -> bool:
        """A shift moves cell positions; cells shared with a pool or another session would
        move for them too and corrupt them, so such a slot stops cleanly instead."""
        assert slot.task is not None
        if not self.rt.can_shift:  # a recurrent state has no positions to move
            return False
        n_keep = min(slot.task.n_keep, slot.n_past - 1)
        if not self.slots.can_shift(slot, n_keep):
            log.info(
                "slot %d: context full; shared cells are never shifted (clean stop)", slot.slot_id
            )
            return False
        return True

    def _shift_context(self, slot: Slot) -> None:
        """Drop half of the slot's history after n_keep so generation can go on."""
        assert slot.task is not None
        n_past = slot.n_past
        n_keep = min(slot.task.n_keep, n_past - 1)
        n_discard = (n_past - n_keep) // 2
        self.slots.shift(slot, n_keep, n_discard)
        self._bump(context_shifts=1)
        log.info("slot %d: context shift, discarded %d tokens", slot.slot_id, n_discard)

    def _finish(self, slot: Slot, stop_type: StopType, truncated: bool = False) -> None:
        task = slot.task
        assert task is not None
        tail = slot.assembler.flush()
        if tail:
            task.sink.emit(TokenEvent(tail, -1))
        result = slot.result(stop_type, truncated, time.perf_counter())
        self._bump(
            requests_done=1,
            predicted_tokens=result.predicted_n,
            predicted_seconds=result.predicted_ms / 1e3,
        )
        longest = len(slot.prompt) + len(slot.generated)
        if longest > self._counters.tokens_max:  # applied before pending bumps: never lost
            self._counters = replace(self._counters, tokens_max=longest)
        self.slots.release(slot)
        # Answered by the next publish, not now: a client that asks where its session lives
        # as soon as the reply arrives (a router, an agent framework) must find it there.
        self._answers.append((task, DoneEvent(result)))

    def _fail(
        self,
        task: GenerateTask,
        status: int,
        type_: str,
        reason: Reason,
        message: str,
        retry_after: int | None = None,
    ) -> None:
        self._bump(requests_failed=1)
        task.sink.emit(ErrorEvent(status, type_, message, reason, retry_after))

    def _fail_pool(self, task: GenerateTask, exc: PoolError, default_type: str) -> None:
        self._fail(task, exc.status, exc.type or default_type, exc.reason, exc.message)

    def _fail_slot(self, slot: Slot, status: int, type_: str, reason: Reason, message: str) -> None:
        assert slot.task is not None
        self._fail(slot.task, status, type_, reason, message)
        self.slots.release(slot)

    # ------------------------------------------------------------------ measurement

    def measure_used_cells(self) -> int | None:
        """llama.cpp's own count of used KV cells (needs ``kv_debug``); None if unavailable."""
        if not self.cfg.kv_debug:
            return None
        return self.rt.measure_used_cells(self.n_seq_max - 1)

    # ------------------------------------------------------------------ publishing

    def _bump(self, **deltas: float) -> None:
        # Summed here and folded into the frozen Counters once per publish: a dataclass
        # replace for every bump cost about 1% of a decode step.
        pending = self._deltas
        for k, v in deltas.items():
            pending[k] = pending.get(k, 0) + v

    def _fold_counters(self) -> Counters:
        if self._deltas:
            c = self._counters
            self._counters = replace(c, **{k: getattr(c, k) + v for k, v in self._deltas.items()})
            self._deltas = {}
        return self._counters

    def _phases(self) -> tuple[tuple[str, bool], ...]:
        """Each slot's state and whether its rate is still warming: a change publishes at
        once (a whole short turn can pass inside one publishing interval)."""
        return tuple((s.state, s.rate.warming) for s in self._slots.slots) if self._slots else ()

    def _publish(self, ready: bool | None = None) -> None:
        now = self._published_at = time.perf_counter()
        self._published_phases = self._phases()
        slots = tuple(self._slots.snapshots()) if self._slots is not None else ()
        pools, pool_index = (
            self._published_pools.update(self._pools.tree) if self._pools is not None else ((), {})
        )
        rt = self.runtime
        self.snapshot = EngineSnapshot(
            ts=time.time(),
            ready=self.snapshot.ready if ready is None else ready,
            slots=slots,
            n_waiting=len(self._waiting),
            aggregate_tps=self._decode_rate.rate(now),
            prefill_tps=self._prefill_rate.rate(now),
            kv_cells_used=self._kv.used if self._kv is not None else 0,
            kv_cells_reclaimable=self._slots.reclaimable_cells() if self._slots else 0,
            kv_cells_total=rt.n_ctx if rt else 0,
            kv_parked_bytes=self._slots.parked_bytes if self._slots is not None else 0,
            pools=pools,
            pool_index=pool_index,
            counters=self._fold_counters(),
            step_curve=self._step_timer.curve(),
            cycle_curve=self._cycle_timer.curve(time.perf_counter()),
            prefill_pending=self._prefill_pending(),
            prefill=self._pacer.model,
            n_batch=rt.n_batch if rt else 0,
        )
        answers, self._answers = self._answers, []
        for task, done in answers:
            task.sink.emit(done)

    def _save_sessions(self) -> None:
        """Write the sessions' caches for the next process (``core.session_snapshots``)."""
        cfg, store, scratch = self.cfg, self.snapshots, self._scratch_seq
        if store is None or scratch is None or self._slots is None or cfg.session_save_mib <= 0:
            return
        try:
            session_snapshots.save_all(
                self.slots,
                self.pools.tree,
                store,
                scratch,
                cfg.session_save_mib << 20,
                cfg.session_save_s,
            )
        except Exception:  # the process is ending: what was written stays, nothing else
            log.exception("writing sessions' caches failed")

    def _prefill_pending(self) -> int:
        """Prompt tokens still to compute: prompts prefilling or waiting (their whole length:
        what a cache will spare is known only on a slot), and pools materializing."""
        if self._slots is None or self._pools is None:
            return 0
        waiting = sum(len(t.prompt) for t in self._waiting)
        return waiting + self._slots.prompt_left() + self._pools.pending_tokens()

    def _shutdown(self) -> None:
        msg = "server is shutting down"
        for task in self._waiting:
            self._fail(task, 503, "unavailable_error", "shutting_down", msg)
        self._waiting.clear()
        for slot in self._slots.slots if self._slots is not None else []:
            if slot.task is not None:
                self._fail_slot(slot, 503, "unavailable_error", "shutting_down", msg)
        if self._pools is not None:
            for build in list(self._pools.builds):
                err = PoolError(503, "shutting_down", msg, "unavailable_error")
                self._pools.fail_build(build, err)
        self._publish(ready=False)
        if self.snapshots is not None:
            self._save_sessions()
            self.snapshots.close()  # the writes already handed over finish first
        for rt in (self._drafter.rt if self._drafter else None, self.runtime):
            if rt is not None:
                try:
                    rt.close()
                except LlamaError:
                    log.exception("error while freeing a llama context")
