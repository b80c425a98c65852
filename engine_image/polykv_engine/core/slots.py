"""Decoding slots and their table: which session holds which slot, and what its KV holds.

A slot is one sequence id of the unified cache (``0..n_parallel-1``) that serves one request
at a time and keeps its cells afterwards as a prompt cache for the session's next turn.

Parking: in a unified cache every decode attends over the whole window of used cells, idle
prompt caches included (masked, but computed). While other slots work, an idle slot's cells
that nobody else holds are moved to host memory and put back, at the same positions, when
its session's next turn begins: a memcpy instead of a prefill, and the busy slots stop paying
for them. Engine thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from polykv_engine.core.prefix import AttachedPool, PrefixPlan, Resident, plan
from polykv_engine.core.snapshot import SlotSnapshot, SlotState
from polykv_engine.core.tasks import GenerateTask, GenerationResult, StopType
from polykv_engine.core.textstream import TextAssembler
from polykv_engine.kv.cache import KVCache
from polykv_engine.kv.memory import Memory
from polykv_engine.llama.runtime import Sampler
from polykv_engine.llama.sampling import SamplingParams
from polykv_engine.persist.fileformat import Span
from polykv_engine.policy.speculation import Speculation
from polykv_engine.policy.tps import SessionRate
from polykv_engine.pools.tree import Pool, PoolError
from polykv_engine.tokens import common_prefix_len

log = logging.getLogger("polykv.engine")


@dataclass(frozen=True, slots=True)
class SlotView:
    """What slot choice needs to know about a slot."""

    slot_id: int
    idle: bool
    session_id: str | None
    cache_tokens: Sequence[int]
    last_used: float
    tenant: str | None = None  # whose cache it holds


@dataclass(frozen=True, slots=True)
class Parked:
    """The private tail of an idle slot's cache, held in host memory."""

    tokens: tuple[int, ...]  # at positions [len(slot.cache_tokens), ...) when put back
    data: bytes | bytearray  # llama.cpp's serialized cells


@dataclass(frozen=True, slots=True)
class ParkStats:
    """What one parking pass did, for the engine's counters."""

    parked_tokens: int = 0
    dropped_tokens: int = 0  # parked tails discarded to stay within the budget


@dataclass(slots=True)
class Slot:
    """One decoding sequence. Mutated only on the engine thread."""

    slot_id: int
    n_ctx: int
    rate: SessionRate
    state: SlotState = "idle"
    cache_tokens: list[int] = field(default_factory=list)  # exactly what is in KV for this seq
    parked: Parked | None = None  # the cache's tail, out of KV while the slot is idle
    session_id: str | None = None
    tenant: str | None = None  # whose request last ran here: its cache is that tenant's
    pool_id: int | None = None  # the pool whose cells this slot's sequence starts with
    shared_prefix: int = 0  # how many leading cells are that pool's
    last_used: float = 0.0
    task: GenerateTask | None = None
    sampler: Sampler | None = None
    prompt: list[int] = field(default_factory=list)
    n_prompt_done: int = 0  # prompt tokens already in KV (cached or prefilled)
    n_cached: int = 0
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # sampled, not yet decoded into KV
    assembler: TextAssembler = field(default_factory=TextAssembler)
    t_start: float = 0.0
    t_first: float = 0.0
    ttft_ms: float | None = None  # the last turn's time to first token
    last_task_id: int = -1
    params: dict[str, Any] = field(default_factory=dict)  # the last request's settings
    seed: int = 0
    logits_idx: int = -1  # index in the current batch whose logits this slot samples
    batch_tokens: int = 0  # tokens this slot put in the current batch
    spec: Speculation | None = None  # the turn's speculative decoding, when on
    draft: list[int] = field(default_factory=list)  # guessed next tokens, in this batch
    draft_idx: int = -1  # batch index of the first drafted token (the rest follow it)

    @property
    def n_past(self) -> int:
        """Positions of the slot's sequence in KV: where its next token goes."""
        return len(self.cache_tokens)

    @property
    def cache_len(self) -> int:
        """Tokens in the slot's whole prompt cache, resident and parked."""
        return len(self.cache_tokens) + (len(self.parked.tokens) if self.parked else 0)

    @property
    def cached(self) -> list[int]:
        """The slot's whole prompt cache: resident cells, then the parked tail."""
        if self.parked is None:
            return self.cache_tokens
        return [*self.cache_tokens, *self.parked.tokens]

    def start(self, task: GenerateTask, sampling: SamplingParams, reused: int, now: float) -> None:
        """Take ``task``'s turn (its sampler is the engine's to set): the first ``reused``
        prompt tokens are in KV already; ``now`` is the perf-counter start of the turn."""
        self.seed = sampling.seed
        self.task = task
        self.last_task_id = task.task_id
        self.params = {  # the turn's settings as /slots shows them (llama-server's names)
            "n_predict": task.stop.n_predict,
            "seed": sampling.seed,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": sampling.min_p,
            "repeat_last_n": sampling.repeat_last_n,
            "repeat_penalty": sampling.repeat_penalty,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "stop": list(task.stop.stops),
            "ignore_eos": task.stop.ignore_eos,
            "n_probs": task.logprobs or 0,
            "grammar": sampling.grammar.gbnf if sampling.grammar else "",
        }
        self.state = "prefill"
        self.prompt = task.prompt
        self.n_prompt_done = reused
        self.n_cached = task.n_cached = reused
        self.generated = []
        self.pending = None
        self.assembler = TextAssembler(list(task.stop.stops))
        self.rate.reset()
        self.spec = None
        self.draft = []
        self.t_start = now
        self.t_first = 0.0
        self.last_used = time.time()

    def result(self, stop_type: StopType, truncated: bool, now: float) -> GenerationResult:
        """The running turn's answer, its timings up to ``now`` (perf counter)."""
        task = self.task
        assert task is not None
        t_first = self.t_first or now
        return GenerationResult(
            content=self.assembler.text,
            tokens=list(self.generated),
            stop_type=stop_type,
            stopping_word=self.assembler.stopping_word or "",
            truncated=truncated,
            slot=self.slot_id,
            session_id=self.session_id,
            seed=self.seed,
            prompt_n=len(self.prompt) - self.n_cached,
            cache_n=self.n_cached,
            predicted_n=len(self.generated),
            prompt_ms=(t_first - self.t_start) * 1e3,
            predicted_ms=(now - t_first) * 1e3,
            tps_ewma=self.rate.tps,
            pool_id=task.pool.pool_id if task.pool is not None else None,
            shared_prefix=task.shared_prefix,
            draft_n=self.spec.drafted if self.spec is not None else 0,
            draft_n_accepted=self.spec.accepted if self.spec is not None else 0,
        )

    def view(self) -> SlotView:
        return SlotView(
            self.slot_id,
            self.state == "idle",
            self.session_id,
            self.cached,
            self.last_used,
            self.tenant,
        )

    def snapshot(self) -> SlotSnapshot:
        """The immutable record published to the HTTP side and read by the pool manager."""
        task = self.task
        n_remain = -1
        if task is not None and task.stop.n_predict >= 0:
            n_remain = max(task.stop.n_predict - len(self.generated), 0)
        return SlotSnapshot(
            slot_id=self.slot_id,
            state=self.state,
            task_id=task.task_id if task else None,
            session_id=self.session_id,
            tenant=self.tenant,
            pool_id=self.pool_id,
            n_ctx=self.n_ctx,
            ctx_used=self.cache_len,
            n_prompt=len(self.prompt),  # the running request's, else the last one's
            n_decoded=len(self.generated),
            n_remain=n_remain,
            tps_ewma=self.rate.tps,
            warming=self.rate.warming,
            last_used=self.last_used,
            shared_prefix=self.shared_prefix if self.pool_id is not None else 0,
            ttft_ms=self.ttft_ms,
            n_cached=self.n_cached,
            n_parked=len(self.parked.tokens) if self.parked is not None else 0,
            last_task_id=self.last_task_id,
            params=self.params,
            speculative=self.spec is not None,
            draft_n=self.spec.drafted if self.spec is not None else 0,
            draft_n_accepted=self.spec.accepted if self.spec is not None else 0,
        )


class SlotTable:
    """All slots and the session → slot affinity, and the one door for a slot's KV: each
    method that changes a slot's cells changes its ``cache_tokens`` in the same call, so the
    two never disagree. Engine thread only."""

    def __init__(
        self,
        slots: list[Slot],
        kv: KVCache,
        scratch: int | None = None,
        park_budget: int = 0,
        memory: Memory | None = None,
    ) -> None:
        self.slots = slots
        self.kv = kv
        self.memory = memory or Memory("attention")
        # Keyed by (tenant, session id): the same id under two tenants is two sessions.
        self.session_slot: dict[tuple[str, str], int] = {}
        # Parking needs a spare sequence id (to save just a tail); None: never park.
        self.scratch = scratch
        self.park_budget = park_budget
        self.park_due = False  # a slot began or ended: idle caches may be worth parking
        self._reclaim_key: tuple[int, tuple[int, ...]] | None = None
        self._reclaim_cells = 0

    @property
    def parked_bytes(self) -> int:
        return sum(len(s.parked.data) for s in self.slots if s.parked is not None)

    def park_idle(self) -> ParkStats:
        """Park the private cells of every idle slot (call while other slots compute).
        The least recently used parked tails go first when the budget is full."""
        self.park_due = False
        if self.scratch is None:
            return ParkStats()
        parked = dropped = 0
        per_token = self.kv.rt.kv_bytes_per_token
        for slot in sorted(self.slots, key=lambda s: s.last_used):  # newest last: kept
            if slot.state != "idle" or slot.parked is not None or not slot.cache_tokens:
                continue
            p0 = self.kv.model.private_from(slot.slot_id)
            tail = len(slot.cache_tokens) - p0
            if tail <= 0 or tail * per_token > self.park_budget:
                continue
            dropped += self._fit(tail * per_token)
            data = self.kv.park(slot.slot_id, self.scratch, p0)
            slot.parked = Parked(tuple(slot.cache_tokens[p0:]), data)
            del slot.cache_tokens[p0:]
            parked += tail
        return ParkStats(parked, dropped)

    def _fit(self, need: int) -> int:
        """Drop the least recently used parked tails until ``need`` more bytes fit."""
        dropped = 0
        by_age = sorted((s for s in self.slots if s.parked is not None), key=lambda s: s.last_used)
        total = self.parked_bytes
        for slot in by_age:
            if total + need <= self.park_budget:
                break
            assert slot.parked is not None
            total -= len(slot.parked.data)
            dropped += len(slot.parked.tokens)
            slot.parked = None
        return dropped

    def unpark(self, slot: Slot, prompt: list[int] | None = None) -> int:
        """Before the slot serves ``prompt``: put its parked tail back when the prompt
        reuses part of it (None: always), else let it go. Returns the tokens put back."""
        parked, slot.parked = slot.parked, None
        if parked is None or self.scratch is None:
            return 0
        if prompt is not None and common_prefix_len(
            [*slot.cache_tokens, *parked.tokens], prompt
        ) <= len(slot.cache_tokens):
            return 0
        n = len(parked.tokens)
        if not self.kv.unpark(slot.slot_id, self.scratch, len(slot.cache_tokens), n, parked.data):
            return 0  # no contiguous room: the prompt is computed again instead
        slot.cache_tokens.extend(parked.tokens)
        return n

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, slot_id: int) -> Slot:
        return self.slots[slot_id]

    def snapshots(self) -> list[SlotSnapshot]:
        return [s.snapshot() for s in self.slots]

    def bind(self, slot: Slot, tenant: str | None, session_id: str | None) -> None:
        """Give ``slot`` to ``tenant``'s ``session_id``; the session it served before loses
        its affinity."""
        if slot.session_id is not None and (slot.tenant, slot.session_id) != (tenant, session_id):
            self.session_slot.pop((slot.tenant or "", slot.session_id), None)
            slot.session_id = None
        slot.tenant = tenant
        if session_id is not None:
            self.session_slot[(tenant or "", session_id)] = slot.slot_id
            slot.session_id = session_id

    def slot_of(self, tenant: str, session_id: str | None) -> int | None:
        return self.session_slot.get((tenant, session_id)) if session_id else None

    def session_tokens(self, session_id: str) -> tuple[int | None, list[int]] | None:
        """The slot and the tokens in KV of a known session (for pool snapshots, which the
        admin asks for: any tenant's session; the most recently used if several tenants use
        the same id). The slot is None when its cells cannot be shared as they are (a
        sliding window recycled some): the tokens are then computed again."""
        holders = [s for s in self.slots if s.session_id == session_id]
        if not holders:
            return None
        slot = max(holders, key=lambda s: s.last_used)
        self.unpark(slot)
        whole = self.cells_from(slot.slot_id) == 0
        return (slot.slot_id if whole else None), list(slot.cache_tokens)

    def load_saved(
        self,
        slot: Slot,
        scratch: int,
        tokens: Sequence[int],
        spans: Sequence[Span],
        share_from: int | None = None,
    ) -> bool:
        """Make the slot's cache a saved one (``core.session_snapshots``): its first
        ``spans[0].start`` cells shared from the sequence ``share_from`` (a pool holding the
        same tokens), then the saved cells. False (the slot then holds nothing) when
        llama.cpp does not take them."""
        self.forget_kv(slot)
        start = spans[0].start if spans else len(tokens)
        if start and share_from is not None:
            self.kv.share(share_from, slot.slot_id, 0, start)
            slot.cache_tokens.extend(tokens[:start])
        for span in spans:
            if not self.kv.load_span(slot.slot_id, scratch, span.start, span.end, span.data):
                self.forget_kv(slot)
                return False
            slot.cache_tokens.extend(tokens[span.start : span.end])
        return True

    def forget_kv(self, slot: Slot) -> None:
        """Drop every cell of the slot's sequence; it holds nothing afterwards."""
        self.kv.clear(slot.slot_id)
        slot.cache_tokens.clear()
        slot.parked = None
        slot.pool_id = None
        slot.shared_prefix = 0

    def truncate(self, slot: Slot, n: int) -> None:
        """Keep the first ``n`` tokens of the slot's cache."""
        self.kv.truncate(slot.slot_id, n)
        del slot.cache_tokens[n:]

    def decoded(self, slot: Slot, tokens: Sequence[int]) -> None:
        """``tokens`` were just decoded at the end of the slot's sequence."""
        self.kv.decoded(slot.slot_id, len(tokens))
        slot.cache_tokens.extend(tokens)

    def shift(self, slot: Slot, n_keep: int, n_discard: int) -> None:
        """Context shift: drop [n_keep, n_keep + n_discard) and move the rest down."""
        self.kv.shift(slot.slot_id, n_keep, n_discard)
        del slot.cache_tokens[n_keep : n_keep + n_discard]

    def can_shift(self, slot: Slot, n_keep: int) -> bool:
        """A shift moves cell positions: cells from ``n_keep`` on that another sequence holds
        (a pool, another session) would move for it too, and be corrupted."""
        return not self.kv.model.shared_from(slot.slot_id, n_keep)

    # -- prefix reuse (the policy is core.prefix; this applies it)

    def residents(
        self, tenant: str | None, besides: Slot | None = None, pool: AttachedPool | None = None
    ) -> list[Resident]:
        """The sequences automatic sharing may take cells from: the tenant's own slots
        (another tenant's would tell, through cache_n and the prefill time, what its prompts
        hold) but ``besides``, then the pool the request attached (a pool it did not name is
        not searched: that would confirm the pool's prompt token by token to a client that
        never attaches it)."""
        found = [
            Resident(s.slot_id, s.cache_tokens, self.cells_from(s.slot_id))
            for s in self.slots
            if s is not besides and s.tenant == tenant and s.cache_tokens
        ]
        if pool is not None:
            found.append(Resident(pool.seq_id, pool.tokens))
        return found

    def prefilling(self, tenant: str | None) -> list[list[int]]:
        """The prompts the tenant's slots are prefilling now."""
        return [s.prompt for s in self.slots if s.state == "prefill" and s.tenant == tenant]

    def prefilling_any(self) -> bool:
        return any(s.state == "prefill" for s in self.slots)

    def prompt_left(self) -> int:
        """Prompt tokens the slots prefilling still have to compute."""
        return sum(len(s.prompt) - s.n_prompt_done for s in self.slots if s.state == "prefill")

    def cached_of(self, tenant: str, session_id: str | None) -> Sequence[int]:
        """The whole prompt cache of the tenant's session (empty when it has no slot)."""
        own = self.slot_of(tenant, session_id)
        return self.slots[own].cached if own is not None else ()

    def plan_prefix(
        self, slot: Slot, task: GenerateTask, pool: AttachedPool | None, share: bool
    ) -> PrefixPlan:
        """What ``slot`` reuses of the task's prompt (``core.prefix.plan`` on this table's
        cells); ``share``: automatic sharing may take other sequences' cells."""
        prompt = task.prompt
        residents = self.residents(task.tenant, slot, pool) if share else []
        return plan(
            prompt,
            slot.cache_tokens,
            reuse_cache=task.cache_prompt,
            pool=pool,
            residents=residents,
            exact_length=self.memory.exact_length,
            n_swa=self.window,
            cache_from=self.cells_from(slot.slot_id),
        )

    @property
    def window(self) -> int:
        """The sliding window whose recycled cells prefix reuse must mind (0: none; a
        hybrid's cache is reused whole or not at all, so its window never matters)."""
        return self.memory.n_swa if self.memory.kind == "sliding_window" else 0

    def cells_from(self, seq: int) -> int:
        """The first position ``seq`` still holds in the window layers (0 where there is no
        window, or nothing was recycled): llama.cpp keeps the rest one unbroken run."""
        return max(self.kv.rt.seq_pos_min(seq), 0) if self.window else 0

    def apply_prefix(self, slot: Slot, plan: PrefixPlan, prompt: Sequence[int]) -> None:
        """Make the slot's cells and tokens what ``plan`` says: the pool's cells first, then
        its own cache cut, then cells shared from another sequence."""
        if plan.pool_fresh:
            self.forget_kv(slot)
            self.kv.share(plan.pool_seq, slot.slot_id, 0, plan.pool_p)
            slot.cache_tokens.extend(prompt[: plan.pool_p])
        elif plan.pool_seq >= 0:
            # The slot's cache already holds the pool's tokens, in cells it computed itself
            # (it ran before the pool existed): swap them for the pool's, so the session is
            # linked to its pool (admission counts it) and its private copy is freed.
            linked = self.kv.model.common_cells(slot.slot_id, plan.pool_seq)
            self.kv.rebase(plan.pool_seq, slot.slot_id, linked, plan.pool_p)
        if plan.dropped_at:
            why = (
                "a recurrent state cannot go back to position %d"
                if self.memory.exact_length
                else "the sliding window before position %d was recycled"
            )
            log.info(f"slot %d: {why}; reprocessing the prompt", slot.slot_id, plan.dropped_at)
            self.forget_kv(slot)
        self.truncate(slot, plan.keep)
        if plan.share_seq >= 0:
            self.kv.share(plan.share_seq, slot.slot_id, plan.keep, plan.reuse)
            slot.cache_tokens.extend(prompt[plan.keep : plan.reuse])

    def unlink_pool(self, pool_id: int) -> None:
        """The pool was removed: slots that start with its cells keep them, as their own."""
        for slot in self.slots:
            if slot.pool_id == pool_id:
                slot.pool_id = None
                slot.shared_prefix = 0

    def link_pool(self, slot: Slot, pool: Pool | None) -> int:
        """Keep ``slot.pool_id`` true (set while the slot's first cells are still ``pool``'s);
        returns how many leading cells the slot shares with ``pool``."""
        if pool is None or pool.seq_id is None:
            slot.pool_id = None
            return 0
        shared = self.kv.model.common_cells(slot.slot_id, pool.seq_id)
        slot.pool_id = pool.pool_id if shared > 0 else None
        return shared

    # -- what gives cells back

    def droppable_caches(self) -> list[int]:
        """Idle slots whose prompt caches free cells when dropped, in the order they should
        go: ones nobody shares first (a shared one keeps helping another sequence), then
        the least recently used."""
        model = self.kv.model
        idle = [
            (model.sharers(s.slot_id) > 0, s.last_used, s.slot_id)
            for s in self.slots
            if s.state == "idle" and s.cache_tokens and model.freed_by_clearing([s.slot_id])
        ]
        return [slot_id for _, _, slot_id in sorted(idle)]

    def reclaimable_cells(self) -> int:
        """Cells only idle prompt caches hold: a new session gets them by dropping caches,
        so they count as headroom. Recomputed only when cell ownership or the idle set
        changed (not on every decoded token)."""
        idle = tuple(s.slot_id for s in self.slots if s.state == "idle" and s.cache_tokens)
        key = (self.kv.version, idle)
        if key != self._reclaim_key:
            self._reclaim_key = key
            self._reclaim_cells = self.kv.model.freed_by_clearing(idle)
        return self._reclaim_cells

    def erase(self, slot_id: int) -> int:
        """llama-server's slot erase: an idle slot's cache and session go; returns tokens."""
        if not 0 <= slot_id < len(self.slots):
            raise PoolError(
                404, "slot_not_found", f"slot {slot_id} does not exist", "not_found_error"
            )
        slot = self.slots[slot_id]
        if slot.state != "idle":
            raise PoolError(409, "slot_busy", f"slot {slot_id} is processing a request")
        n = slot.cache_len
        self.forget_kv(slot)
        self.bind(slot, None, None)
        return n

    def release(self, slot: Slot) -> None:
        """Return a slot to idle. Its KV stays as a prompt cache for the next turn."""
        # A sampled-but-undecoded token is not in KV, and a half-prefilled prompt is still a
        # valid cached prefix: cache_tokens stays exactly what the KV holds.
        slot.pending = None
        if slot.sampler is not None:
            slot.sampler.free()
            slot.sampler = None
        slot.task = None
        slot.state = "idle"
        slot.last_used = time.time()
        self.park_due = True
