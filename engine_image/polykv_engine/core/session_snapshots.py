"""Sessions' caches across a restart: written at shutdown, restored at their next turn
(engine thread only).

At shutdown, once the drain is over, every slot holding a session's cache (its cells in the
KV cache and a parked tail in host memory) is written to the snapshot store under the
session's key: its tenant and its id, so another tenant's lookup names another file, and a
file put under a name it should not have is refused by its header (``other_prefix``). The
most recently used sessions go first (the likeliest to come back), within a byte budget
(``--polykv-session-save-mib``) and a deadline (``--polykv-session-save-s``): the pod's
grace period ends the process, so a session not begun by then is not written.

A session attached to a declared pool writes only its cells beyond the pool's prefix,
[P, end); the header's tokens name the prefix [0, P) token by token. Its restore shares the
cells of a resident pool that holds those tokens first, as a child pool shares its parent's
(the operator re-creates pools at start, from their own snapshots), so a pool's cells are
never duplicated by its sessions. No such pool: refused (``parent_not_resident``), and the
turn is prefilled. A kept prefix is the tenant's own and not written to disk: a session on
one is written whole.

Restored lazily, at the session's next turn, not at boot: the new process has as many slots
as the old one, pools need the cells first, and a session that never comes back (its agent
ended with the rollout) costs a file, not a slot and KV cells. The file is read and checked
off the engine thread (``http.session_restore``) and removed once its cells are loaded.
"""

from __future__ import annotations

import logging
import time

from polykv_engine.core.slots import Slot, SlotTable
from polykv_engine.kv.memory import save_spans
from polykv_engine.persist.fileformat import KVSnapshot, SnapshotRefused, Span
from polykv_engine.persist.store import SnapshotStore
from polykv_engine.pools.tree import Pool, PoolTree

log = logging.getLogger("polykv.sessions")


def save_all(
    slots: SlotTable,
    tree: PoolTree,
    store: SnapshotStore,
    scratch: int,
    budget: int,
    seconds: float,
) -> int:
    """Write every session's cache, most recently used first, while ``budget`` bytes and
    ``seconds`` last; returns the sessions written."""
    t0 = time.monotonic()
    deadline = t0 + seconds
    held = sorted(
        (s for s in slots.slots if s.session_id and s.tenant is not None and s.cache_len),
        key=lambda s: s.last_used,
        reverse=True,
    )
    if not held:
        return 0
    log.info(
        "writing %d session cache(s): at most %.0f MiB, %.1fs", len(held), budget / 2**20, seconds
    )
    rt = slots.kv.rt
    spent = written = 0
    for i, slot in enumerate(held, 1):
        now = time.monotonic()
        start = _pool_prefix(slots, tree, slot)
        size = (slot.cache_len - start) * rt.kv_bytes_per_token + rt.state_bytes
        rate = spent / (now - t0) if spent else 0.0
        if now >= deadline or (rate and now + size / rate > deadline):
            store.session_counted(saved="deadline")
            log.warning("session cache %d/%d not written: the deadline passed", i, len(held))
            continue
        if slots.window and slots.cells_from(slot.slot_id) > 0:
            store.session_counted(saved="not_whole")  # its window's first cells were recycled
            continue
        if spent + size > budget:
            store.session_counted(saved="over_budget")
            log.info("session cache %d/%d not written: over the byte budget", i, len(held))
            continue
        assert slot.session_id is not None and slot.tenant is not None
        key = store.session_key(slot.tenant, slot.session_id)
        spans = _spans(slots, slot, scratch, start)
        copied = time.monotonic()
        left = deadline - copied
        ok = store.save(key, spans, slot.cache_len, slot.cached, wait=True, timeout=left)
        if not ok and time.monotonic() >= deadline:
            # The writer goes on with it while the process ends: whole, or never named.
            store.session_counted(saved="deadline")
            log.warning("session cache %d/%d: the deadline passed while writing it", i, len(held))
            continue
        store.session_counted(saved="written" if ok else "not_written")
        if ok:
            size = sum(len(span.data) for span in spans)
            spent += size
            written += 1
            log.info(
                "session cache %d/%d written: %d positions (%d shared with a pool), %.1f MiB "
                "(copied out in %.2fs), %.2fs so far",
                i,
                len(held),
                slot.cache_len,
                start,
                size / 2**20,
                copied - now,
                time.monotonic() - t0,
            )
    took = time.monotonic() - t0
    log.info("%d of %d session cache(s) written in %.2fs", written, len(held), took)
    return written


def _pool_prefix(slots: SlotTable, tree: PoolTree, slot: Slot) -> int:
    """How many leading cells the slot shares with the declared pool it is attached to
    (0: none, or a kept prefix, which never goes to disk)."""
    pool = tree.pools.get(slot.pool_id) if slot.pool_id is not None else None
    if pool is None or pool.kept or pool.seq_id is None or pool.residency != "resident":
        return 0
    return min(slots.kv.model.common_cells(slot.slot_id, pool.seq_id), len(slot.cache_tokens))


def _spans(slots: SlotTable, slot: Slot, scratch: int, start: int) -> list[Span]:
    """The slot's cells from ``start`` on: the resident ones copied out (a window at a time
    on a sliding-window model), then the parked tail as it was parked."""
    kv, end = slots.kv, len(slot.cache_tokens)
    spans = [
        Span(a, b, kv.save_span(slot.slot_id, scratch, a, b))
        for a, b in save_spans(start, end, kv.rt.info.n_swa)
    ]
    if slot.parked is not None:
        spans.append(Span(end, slot.cache_len, slot.parked.data))
    return spans


def restore(
    slots: SlotTable, tree: PoolTree, slot: Slot, scratch: int, snap: KVSnapshot, tenant: str
) -> Pool | None:
    """Load a session's saved cache into the idle ``slot``; the pool whose cells it shares
    (None: saved whole). ``SnapshotRefused`` (the slot then holds nothing) when it cannot."""
    tokens = snap.tokens
    if tokens is None:
        raise SnapshotRefused("corrupt", "a session snapshot without its tokens")
    start, end = snap.start, snap.end
    pool = None
    if start > 0:
        exact = slots.memory.exact_length  # a recurrent state exists only at a pool's end
        pool = next(
            (
                p
                for p in tree.pools.values()
                if p.residency == "resident"
                and p.seq_id is not None
                and p.owner in (None, tenant)
                and (p.prefix_len == start if exact else p.prefix_len >= start)
                and p.tokens[:start] == list(tokens[:start])
            ),
            None,
        )
        if pool is None:
            raise SnapshotRefused(
                "parent_not_resident", f"no resident pool holds its first {start} tokens"
            )
    kv = slots.kv
    free = kv.rt.n_ctx - kv.used + kv.model.freed_by_clearing([slot.slot_id])
    if not slots.memory.exact_length and end - start > free:
        raise SnapshotRefused("no_room", f"{end - start} cells needed, {free} free in the KV cache")
    if not slots.load_saved(slot, scratch, tokens, snap.spans, pool.seq_id if pool else None):
        raise SnapshotRefused(
            "rejected", "llama.cpp did not load the session's cells (no room, or bytes it refuses)"
        )
    return pool
