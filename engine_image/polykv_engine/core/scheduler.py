"""What runs in the next step: which slot serves a waiting request, what goes into the
batch, and what to shed when llama.cpp finds no free KV cell.

``choose_slot`` and ``pick_shed`` are pure (views in, a decision out) so their order is
unit-tested without a model; the engine applies their decisions.

Slot choice, as a demanding agent framework expects:
1. a request whose session is bound to a slot goes back to that slot (its KV is there) and
   waits for it if that slot is busy;
2. an explicit ``id_slot`` waits for that slot, if the slot is the tenant's own or holds
   nothing (``may_name``; another tenant's session or cache is refused, never evicted);
3. otherwise an idle slot no session owns (another session's cache is its next turn's
   speed-up: taken only when nothing else is free, least recently used first), then the one
   whose cached tokens share the longest prefix with the prompt (llama-server's prompt-cache
   reuse), then the least recently used one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from polykv_engine.core.slots import Slot, SlotView
from polykv_engine.llama.runtime import Batch
from polykv_engine.pools.manager import PoolManager
from polykv_engine.tokens import common_prefix_len


def may_name(slot: SlotView, tenant: str) -> bool:
    """Whether ``id_slot`` may give ``slot`` to ``tenant``: it is the tenant's, or holds
    nothing of anyone's (naming a slot would otherwise evict another tenant's idle cache at
    will, or take its running session's slot when it ends)."""
    held = not slot.idle or slot.session_id is not None or bool(slot.cache_tokens)
    return slot.tenant in (None, tenant) or not held


def choose_slot(
    slots: Sequence[SlotView],
    prompt: Sequence[int],
    session_slot: int | None,
    id_slot: int,
    cache_prompt: bool,
    tenant: str = "",
) -> int | None:
    """The slot to use now, or None when the request must keep waiting. Another tenant's
    cache is never reused, so it never counts as a shared prefix here."""
    if session_slot is not None:
        return session_slot if slots[session_slot].idle else None
    if id_slot >= 0:
        return id_slot if slots[id_slot].idle else None
    best: tuple[bool, int, float] | None = None
    chosen: int | None = None
    for s in slots:
        if not s.idle:
            continue
        free = s.session_id is None
        reusable = cache_prompt and free and s.tenant in (None, tenant)
        lcp = common_prefix_len(s.cache_tokens, prompt) if reusable else 0
        key = (free, lcp, -s.last_used)
        if best is None or key > best:
            best, chosen = key, s.slot_id
    return chosen


def build_batch(
    batch: Batch, slots: Sequence[Slot], pools: PoolManager, prompt_budget: int | None = None
) -> None:
    """One token for every decoding slot first (running sessions never wait on prompts),
    then the tokens speculation drafted for them, then prompt chunks in arrival order (an
    early long prompt is not starved by later short ones), then chunks of pools being
    materialized, up to the batch's capacity and at most ``prompt_budget`` prompt and pool
    tokens (``policy.prefill``; None: no limit)."""
    batch.clear()
    budget = batch.capacity
    for slot in slots:
        slot.logits_idx = -1
        slot.batch_tokens = 0
    for slot in slots:
        if slot.state == "decoding" and slot.pending is not None and budget > 0:
            pos = len(slot.cache_tokens)
            slot.logits_idx = batch.add(slot.pending, pos, slot.slot_id, True)
            slot.batch_tokens = 1
            budget -= 1
    for slot in slots:  # drafted tokens after every session's own: each gets its logits
        if slot.batch_tokens and slot.draft:
            slot.draft = slot.draft[:budget]
            pos = len(slot.cache_tokens) + 1
            slot.draft_idx = batch.n
            for i, tok in enumerate(slot.draft):
                batch.add(tok, pos + i, slot.slot_id, True)
            slot.batch_tokens += len(slot.draft)
            budget -= len(slot.draft)
    if prompt_budget is not None:
        budget = min(budget, prompt_budget)
    prefilling = sorted((s for s in slots if s.state == "prefill"), key=lambda s: s.t_start)
    for slot in prefilling:
        if budget <= 0:
            break
        remaining = len(slot.prompt) - slot.n_prompt_done
        n = min(remaining, budget)
        chunk = slot.prompt[slot.n_prompt_done : slot.n_prompt_done + n]
        last = batch.add_span(chunk, len(slot.cache_tokens), slot.slot_id, n == remaining)
        if n == remaining:
            slot.logits_idx = last
        slot.batch_tokens = n
        budget -= n
    pools.add_to_batch(batch, budget)


# ---------------------------------------------------------------------------- shedding

ShedAction = Literal[
    "drop_cache",  # forget an idle slot's prompt cache (only an optimisation)
    "evict_pool",  # evict an unpinned pool nobody used within the grace TTL
    "fail_build",  # give up a pool being materialized (503, the caller may retry)
    "defer_prompt",  # fail a prompt still prefilling while others decode (503, retry)
    "reject_prompt",  # the prompt alone cannot fit (400)
    "stop_session",  # end a running generation early (truncated)
]


@dataclass(frozen=True, slots=True)
class ActiveSlot:
    slot_id: int
    prefilling: bool
    t_start: float


@dataclass(frozen=True, slots=True)
class ShedView:
    """What can give KV cells back, each list in the order it should go."""

    idle_caches: Sequence[int]  # idle slots holding cells, least recently used first
    reclaimable_pools: Sequence[int]  # pool ids, least recently used first
    builds_in_batch: Sequence[int]  # pool ids of builds in this batch, oldest first
    active: Sequence[ActiveSlot]


@dataclass(frozen=True, slots=True)
class Shed:
    action: ShedAction
    target: int  # a slot id, or a pool id for the pool actions


def pick_shed(view: ShedView) -> Shed | None:
    """What to free next when the batch does not fit in the free cells; None: nothing left.

    Cheapest loss first: caches nobody is using, then idle pools (re-materialized on use),
    then work that has not produced anything yet (pool builds, then prompts, which clients
    retry), and only then a running session, the youngest one.
    """
    if view.idle_caches:
        return Shed("drop_cache", view.idle_caches[0])
    if view.reclaimable_pools:
        return Shed("evict_pool", view.reclaimable_pools[0])
    if view.builds_in_batch:
        return Shed("fail_build", view.builds_in_batch[-1])
    prefilling = [a for a in view.active if a.prefilling]
    if prefilling and len(prefilling) < len(view.active):
        youngest = max(prefilling, key=lambda a: a.t_start)
        return Shed("defer_prompt", youngest.slot_id)
    if not view.active:
        return None
    victim = max(view.active, key=lambda a: a.t_start)
    return Shed("reject_prompt" if victim.prefilling else "stop_session", victim.slot_id)
