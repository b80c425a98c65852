"""Pool operations as they run on the engine thread (``Engine.call`` targets).

Each function validates first (raising ``PoolError``, which changes nothing) and only then
touches the tree or the KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from polykv_api.models import AdmissionPolicy, PoolList, PoolRef, PoolSession, PoolStatus
from polykv_engine.core.engine import Engine
from polykv_engine.core.snapshot import SlotSnapshot
from polykv_engine.pools import kept
from polykv_engine.pools import listing as pool_listing
from polykv_engine.pools.manager import CreateResult, PoolSpec
from polykv_engine.pools.tree import Pool, PoolError

Action = Literal["pin", "unpin", "evict", "flush"]

# Whether the caller may see the session ids of a tenant (http.tenants.Identity.sees).
Viewer = Callable[[str | None], bool]


def _enabled(e: Engine) -> None:
    if e.pools_disabled_reason:
        raise PoolError(501, "pools_disabled", e.pools_disabled_reason, "not_supported_error")


def create(e: Engine, spec: PoolSpec) -> CreateResult | Pool:
    _enabled(e)
    return e.pools.create(spec)


def act(e: Engine, ref: PoolRef, action: Action) -> None:
    _enabled(e)
    pool = e.pools.tree.resolve(ref)
    snaps = e.slots.snapshots()
    if action == "pin":
        e.pools.pin(pool, True)
    elif action == "unpin":
        e.pools.pin(pool, False)
    elif action == "evict":
        e.pools.evict(pool, snaps)
    else:
        pools, sessions = e.pools.flush_plan(pool, snaps)
        for s in sessions:  # idle sessions' cached suffixes go with the subtree
            e.slots.forget_kv(e.slots[s.slot_id])
        e.pools.flush(pools)


def release(e: Engine, ref: PoolRef) -> int:
    _enabled(e)
    pool = e.pools.tree.resolve(ref)
    e.pools.release(pool)  # sessions keep the cells; they are just no longer a pool's
    return pool.pool_id


def keep_prefix(e: Engine, ask: kept.KeepAsk, budget: int) -> kept.Kept | None:
    """The kept prefix for a request's breakpoint (``pools.kept``): the tenant's one that
    holds it whole (its TTL extended), else a new one seeded from the closest. None: not
    kept (pools off, no budget, no sequence id free of declared pools)."""
    if e.pools_disabled_reason or budget <= 0 or len(ask.tokens) < kept.KEEP_MIN_TOKENS:
        return None
    tree = e.pools.tree
    mine = [p for p in tree.pools.values() if p.owner == ask.tenant]
    seed, shared = kept.closest(mine, ask.tokens)
    if seed is not None and shared == len(ask.tokens):
        seed.last_access_ts = time.time()
        kept.extend(seed, ask.ttl_s, seed.last_access_ts)
        tree.mark(seed)
        return kept.Kept(seed.pool_id, 0)
    if shared < kept.KEEP_MIN_TOKENS:
        seed, shared = None, 0  # a few template tokens: not worth holding a seed for
    going = kept.over_budget(mine, budget, seed)
    if len(mine) - len(going) >= budget:
        return None  # the rest are still materializing
    for pool in going:
        e.pools.release(pool)
    if not tree.seq_free():  # another tenant's least recently used one goes, if idle
        others = [p for p in tree.pools.values() if p.kept and p.residency == "resident"]
        others = [p for p in others if p is not seed]
        if not others:
            return None
        e.pools.release(min(others, key=lambda p: p.last_access_ts))
    pool = e.pools.keep(ask.tokens, ask.tenant, ask.ttl_s, seed, shared)
    return kept.Kept(pool.pool_id, len(ask.tokens) - shared)


def expire_kept(e: Engine, now: float) -> int:
    """Release the kept prefixes whose TTL has passed; returns how many."""
    gone = kept.expired(list(e.pools.tree.pools.values()), now)
    for pool in gone:
        e.pools.release(pool)
    return len(gone)


def listing(e: Engine, boot_id: str, sees: Viewer | None = None) -> PoolList:
    """Status of every pool and the engine-wide figures; ``sees``: sessions of tenants the
    caller may not see are listed without their ids, and their kept prefixes not at all."""
    snaps = e.slots.snapshots()
    out = pool_listing.render(e.pools, snaps, boot_id, e.rt.n_ctx, e.measure_used_cells())
    if sees is not None:
        pools = e.pools.tree.pools
        out.pools = [p for p in out.pools if _visible(pools[p.pool_id], sees)]
        rows = [s for p in out.pools for s in p.sessions] + out.unpooled_sessions
        _redact(rows, snaps, sees)
    return out


def _visible(pool: Pool, sees: Viewer) -> bool:
    return not pool.kept or sees(pool.owner)


def subtree(e: Engine, ref: PoolRef, sees: Viewer | None = None) -> list[PoolStatus]:
    """Status of ``ref`` and of its descendants, the pool first."""
    snaps = e.slots.snapshots()
    pool = e.pools.tree.resolve(ref)
    if sees is not None and not _visible(pool, sees):
        raise PoolError(404, "pool_not_found", f"pool {ref!r} does not exist", "not_found_error")
    out = pool_listing.subtree(e.pools, snaps, pool)
    if sees is not None:
        _redact([s for p in out for s in p.sessions], snaps, sees)
    return out


def _redact(rows: Iterable[PoolSession], snaps: Sequence[SlotSnapshot], sees: Viewer) -> None:
    """Another tenant's session keeps its figures (KV, rate: capacity is everyone's
    concern), not its id. Done here, from the snapshots the listing was built from."""
    tenant = {s.slot_id: s.tenant for s in snaps}
    for row in rows:
        if not sees(tenant.get(row.slot)):
            row.session_id = None


def erase_slot(e: Engine, slot_id: int) -> int:
    """llama-server's ``POST /slots/{id}?action=erase``; returns the tokens erased."""
    return e.slots.erase(slot_id)


def release_session(e: Engine, tenant: str, session_id: str) -> int:
    """The session's last turn is over (a "session final" header): its cache goes now
    instead of waiting to be evicted; returns the tokens released (0: not here, or busy)."""
    slot = e.slots.slot_of(tenant, session_id)
    if slot is None or e.slots[slot].state != "idle":
        return 0
    return e.slots.erase(slot)


def set_admission(e: Engine, ref: PoolRef, policy: AdmissionPolicy | None) -> None:
    _enabled(e)
    pool = e.pools.tree.resolve(ref)
    pool.admission = policy
    e.pools.tree.mark(pool)
