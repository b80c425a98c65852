"""A pool's cells to and from a snapshot (engine thread only).

A pool's snapshot holds its own range [D, L) only: a child's restore shares its parent's
cells [0, D) first, exactly as its build would, so restored trees keep one copy of every
ancestor. Cells go through a scratch sequence (``KVCache.save_span``/``load_span``), a span
at a time: a window at a time on a sliding-window model (``kv.memory.save_spans``). A
restore that fails part way clears what it put in: nothing partial stays in the cache.
"""

from __future__ import annotations

import logging

from polykv_engine.kv.cache import KVCache
from polykv_engine.kv.memory import save_spans
from polykv_engine.persist.fileformat import KVSnapshot, SnapshotRefused, Span
from polykv_engine.persist.store import SnapshotStore
from polykv_engine.pools.tree import Pool

log = logging.getLogger("polykv.pools")


def save(kv: KVCache, scratch: int, store: SnapshotStore, pool: Pool) -> None:
    """Hand the pool's own cells to the store's writer, unless it has them already or
    would not take them."""
    d, end = pool.branch_pos, pool.prefix_len
    if end <= d or pool.seq_id is None:
        return  # nothing of its own: its parent's snapshot is all it needs
    key = store.pool_key(pool.tokens)
    if store.size_of(key.digest) is not None:
        return
    rt = kv.rt
    skip = store.accepts((end - d) * rt.kv_bytes_per_token + rt.state_bytes)
    if skip is not None:
        store.skip(skip, f"pool {pool.label}")
        return
    spans = [
        Span(a, b, kv.save_span(pool.seq_id, scratch, a, b))
        for a, b in save_spans(d, end, rt.info.n_swa)
    ]
    store.save(key, spans, end)


def restore(kv: KVCache, scratch: int, pool: Pool, parent: Pool | None, snap: KVSnapshot) -> None:
    """Materialize ``pool`` from ``snap``; ``SnapshotRefused`` (and the pool's sequence
    empty) when it cannot be."""
    d, end = pool.branch_pos, pool.prefix_len
    if (snap.start, snap.end) != (d, end):
        raise SnapshotRefused(
            "other_branch",
            f"the snapshot holds positions [{snap.start}, {snap.end}), the pool owns [{d}, {end})",
        )
    if parent is not None and (parent.residency != "resident" or parent.seq_id is None):
        raise SnapshotRefused(
            "parent_not_resident", f"parent {parent.label!r} is {parent.residency}"
        )
    info = kv.rt.info
    if not info.is_recurrent and kv.used + (end - d) > kv.rt.n_ctx:
        raise SnapshotRefused(
            "no_room", f"{end - d} cells needed, {kv.rt.n_ctx - kv.used} free in the KV cache"
        )
    seq = pool.seq_id
    assert seq is not None
    if parent is not None:
        assert parent.seq_id is not None
        kv.share(parent.seq_id, seq, 0, d)
    for span in snap.spans:
        if not kv.load_span(seq, scratch, span.start, span.end, span.data):
            kv.clear(seq)
            raise SnapshotRefused(
                "rejected",
                f"llama.cpp did not load positions [{span.start}, {span.end}) (no room for "
                "them, or bytes it refuses)",
            )
