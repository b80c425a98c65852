"""Immutable views of engine state, published by the engine thread after every step.

HTTP handlers and the metrics collector read the latest ``EngineSnapshot`` (one reference
assignment, so no lock and no round trip to the engine thread) and never see half an update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from polykv_api.models import AdmissionPolicy, PoolRef
from polykv_engine.policy.prefill import PrefillModel
from polykv_engine.policy.step_time import StepCurve
from polykv_engine.policy.tps import ActiveRates, active_rates
from polykv_engine.pools.tree import PoolTree

SlotState = Literal["idle", "prefill", "decoding"]


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    slot_id: int
    state: SlotState
    task_id: int | None
    session_id: str | None
    tenant: str | None  # opaque: whose session (listings show others' without ids)
    pool_id: int | None
    n_ctx: int
    ctx_used: int
    n_prompt: int
    n_decoded: int
    n_remain: int
    tps_ewma: float
    warming: bool
    last_used: float
    shared_prefix: int = 0  # leading cells that are the pool's (not this session's own)
    ttft_ms: float | None = None  # the last turn's time to first token
    n_cached: int = 0  # prompt tokens the last request reused from KV
    n_parked: int = 0  # of ctx_used, the tokens whose cells are parked in host memory
    last_task_id: int = -1
    params: dict[str, Any] = field(default_factory=dict)  # the last request's settings
    speculative: bool = False  # the turn drafts tokens (speculative decoding)
    draft_n: int = 0  # tokens drafted in the turn
    draft_n_accepted: int = 0  # of those, kept

    @property
    def processing(self) -> bool:
        return self.state != "idle"


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    pool_id: int
    name: str | None
    prefix_len: int
    residency: str
    admission: AdmissionPolicy | None
    owner: str | None = None  # a kept prefix's tenant (pools.kept); None: a declared pool
    kept_until: float = 0.0

    @property
    def label(self) -> str:
        return self.name or str(self.pool_id)


class PublishedPools:
    """The pools as the engine publishes them, kept up to date pool by pool: only pools the
    tree marked as changed are snapshotted again, so a publish after a create costs the same
    with 10 or 250 other pools (the containers are copied, in C, only when one changed)."""

    def __init__(self) -> None:
        self._live: dict[int, PoolSnapshot] = {}  # creation order
        self._index: dict[PoolRef, PoolSnapshot] = {}  # by id and by name
        self._published: tuple[tuple[PoolSnapshot, ...], Mapping[PoolRef, PoolSnapshot]] = (
            (),
            MappingProxyType({}),
        )

    def update(
        self, tree: PoolTree
    ) -> tuple[tuple[PoolSnapshot, ...], Mapping[PoolRef, PoolSnapshot]]:
        changed = tree.take_changed()
        if not changed:
            return self._published
        live, index = self._live, self._index
        for pid in sorted(changed):  # older first: a released name may be a newer pool's now
            old = live.get(pid)
            if old is not None:
                index.pop(pid, None)
                if old.name is not None:
                    index.pop(old.name, None)
            pool = tree.pools.get(pid)
            if pool is None:
                live.pop(pid, None)
                continue
            snap = PoolSnapshot(
                pool.pool_id,
                pool.name,
                pool.prefix_len,
                pool.residency,
                pool.admission,
                pool.owner,
                pool.kept_until,
            )
            live[pid] = index[pid] = snap  # replaced in place: the order stays creation order
            if pool.name is not None:
                index[pool.name] = snap
        self._published = (tuple(live.values()), MappingProxyType(dict(index)))
        return self._published


@dataclass(frozen=True, slots=True)
class Counters:
    """Monotonic totals since boot (Prometheus counters read these)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    cache_tokens: int = 0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    requests_done: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    decoded_tokens: int = 0  # generated tokens, counted every step (not at request end)
    prefilled_tokens: int = 0  # prompt and pool tokens computed, counted every step
    busy_seconds: float = 0.0  # wall time of loop iterations that had work
    decode_calls: int = 0
    decode_seconds: float = 0.0
    step_seconds: float = 0.0
    kv_full_events: int = 0
    context_shifts: int = 0
    busy_slot_steps: int = 0  # Σ over decode calls of the slots in the batch
    slot_decode_calls: int = 0  # decode calls carrying a slot (not pool builds alone)
    auto_shared_tokens: int = 0  # prompt tokens shared from another sequence (no pool)
    kv_parked_tokens: int = 0  # idle caches' cells moved to host memory
    kv_unparked_tokens: int = 0  # parked cells put back for their session's next turn
    kv_park_dropped_tokens: int = 0  # parked cells discarded to stay within the budget
    tokens_max: int = 0  # longest sequence seen (prompt + generation)
    prefill_paced_steps: int = 0  # steps whose prompt work the floor's budget cut short
    spec_draft_tokens: int = 0  # tokens speculative decoding drafted
    spec_accepted_tokens: int = 0  # of those, kept


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    ts: float
    ready: bool
    slots: tuple[SlotSnapshot, ...] = ()
    n_waiting: int = 0
    aggregate_tps: float = 0.0
    prefill_tps: float = 0.0
    kv_cells_used: int = 0
    kv_cells_total: int = 0
    kv_cells_reclaimable: int = 0  # held only by idle prompt caches: free on demand
    kv_parked_bytes: int = 0  # host memory holding parked idle caches
    pools: tuple[PoolSnapshot, ...] = ()
    pool_index: Mapping[PoolRef, PoolSnapshot] = field(default_factory=dict)  # by id and name
    counters: Counters = field(default_factory=Counters)
    step_curve: StepCurve = field(default_factory=StepCurve)  # decode step time by batch size
    cycle_curve: StepCurve = field(default_factory=StepCurve)  # token-to-token time, any step
    # Prompt tokens the engine has promised to compute (prompts prefilling or waiting for a
    # slot, pools materializing) and how it paces them beside decoding sessions.
    prefill_pending: int = 0
    prefill: PrefillModel = field(default_factory=PrefillModel)
    n_batch: int = 0  # tokens one step can carry

    @property
    def n_ctx_slot(self) -> int:
        """Tokens one slot's context holds (every slot has the same)."""
        return self.slots[0].n_ctx if self.slots else 0

    def pool(self, ref: PoolRef) -> PoolSnapshot | None:
        return self.pool_index.get(ref)

    @property
    def n_processing(self) -> int:
        return sum(1 for s in self.slots if s.processing)

    @property
    def active(self) -> ActiveRates:
        """Engine-wide mean_active_tps and its parts (policy.tps is the one definition)."""
        return active_rates((s.state == "decoding", s.warming, s.tps_ewma) for s in self.slots)
