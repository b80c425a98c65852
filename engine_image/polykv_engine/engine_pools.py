"""Pool operations as they run on the engine thread (``Engine.call`` targets).

Each function validates first (raising ``PoolError``, which changes nothing) and only then
touches the tree or the KV cache.
"""

from __future__ import annotations

from typing import Literal

from polykv_api.models import PoolList

from .admission import Policy
from .engine import Engine
from .pool_manager import CreateResult, PoolSpec
from .pooltree import Pool, PoolError

Action = Literal["pin", "unpin", "evict", "flush"]


def _enabled(e: Engine) -> None:
    if e.pools_disabled_reason:
        raise PoolError(501, e.pools_disabled_reason, "not_supported_error")


def create(e: Engine, spec: PoolSpec) -> CreateResult | Pool:
    _enabled(e)
    return e.pools.create(spec)


def act(e: Engine, ref: int | str, action: Action) -> None:
    _enabled(e)
    pool = e.pools.tree.resolve(ref)
    refs = [s.ref() for s in e.slots]
    if action == "pin":
        e.pools.pin(pool, True)
    elif action == "unpin":
        e.pools.pin(pool, False)
    elif action == "evict":
        e.pools.evict(pool, refs)
    else:
        pools, sessions = e.pools.flush_plan(pool, refs)
        for s in sessions:  # idle sessions' cached suffixes go with the subtree
            slot = e.slots[s.slot_id]
            e.kv.clear(slot.slot_id)
            slot.cache_tokens.clear()
            slot.pool_id = None
        e.pools.flush(pools)


def release(e: Engine, ref: int | str) -> int:
    _enabled(e)
    pool = e.pools.tree.resolve(ref)
    e.pools.release(pool)
    for slot in e.slots:  # sessions keep the cells; they are just no longer a pool's
        if slot.pool_id == pool.pool_id:
            slot.pool_id = None
    return pool.pool_id


def listing(e: Engine, boot_id: str, ref: int | str | None = None) -> PoolList:
    """Status of every pool, or of ``ref``'s subtree (the pool first)."""
    measured = e.measure_used_cells()
    refs = [s.ref() for s in e.slots]
    full = e.pools.status(refs, boot_id, e.rt.n_ctx, measured)
    if ref is None:
        return full
    pool = e.pools.tree.resolve(ref)
    keep = {pool.pool_id, *(d.pool_id for d in e.pools.tree.descendants(pool))}
    full.pools = [p for p in full.pools if p.pool_id in keep]
    return full


def erase_slot(e: Engine, slot_id: int) -> int:
    """Drop an idle slot's cached tokens and its session binding; returns tokens erased."""
    if not 0 <= slot_id < len(e.slots):
        raise PoolError(404, f"slot {slot_id} does not exist", "not_found_error")
    slot = e.slots[slot_id]
    if slot.state != "idle":
        raise PoolError(409, f"slot {slot_id} is processing a request")
    n = len(slot.cache_tokens)
    e.kv.clear(slot_id)
    slot.cache_tokens.clear()
    slot.pool_id = None
    if slot.session_id is not None:
        e.session_slot.pop(slot.session_id, None)
        slot.session_id = None
    return n


def set_admission(e: Engine, ref: int | str, policy: Policy | None) -> None:
    _enabled(e)
    e.pools.tree.resolve(ref).admission = policy
