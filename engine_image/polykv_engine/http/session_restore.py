"""A session's cache saved by an earlier process, found and read for its next turn.

The engine thread loads the cells (``core.session_snapshots``); finding the file and
checking every byte of it (header, key, sha256) happens here, off the engine thread and the
event loop, so other sessions decode meanwhile. A file that fails its checks is removed and
counted with its reason, and the turn is prefilled.
"""

from __future__ import annotations

import asyncio

from polykv_engine.core.tasks import GenerateTask
from polykv_engine.http.app_context import AppContext
from polykv_engine.persist.fileformat import KVSnapshot, SnapshotRefused


def _held(ctx: AppContext, tenant: str, session_id: str) -> bool:
    """Whether a slot of this process holds (or last held) the session's cache."""
    return any(s.session_id == session_id and s.tenant == tenant for s in ctx.engine.snapshot.slots)


async def saved_cache(ctx: AppContext, task: GenerateTask) -> KVSnapshot | None:
    """The session's stored cache, checked; None when there is none, this process holds
    the session already, or the file is refused (logged and counted by the store)."""
    store, sid = ctx.engine.snapshots, task.session_id
    if store is None or sid is None or not task.cache_prompt or _held(ctx, task.tenant, sid):
        return None
    key = store.session_key(task.tenant, sid)
    if await asyncio.to_thread(store.find, key) is None:
        return None
    n_ctx = ctx.engine.snapshot.n_ctx_slot
    n_swa = ctx.engine.runtime.info.n_swa if ctx.engine.runtime is not None else 0
    bound = store.bound(n_ctx, n_spans=n_ctx // n_swa + 2 if n_swa else 2, header_tokens=n_ctx)
    try:
        return await asyncio.to_thread(store.load, key, bound)
    except SnapshotRefused:
        store.session_counted(restored="refused")  # the store logged the reason
        return None


async def stored_length(ctx: AppContext, tenant: str, session_id: str) -> int | None:
    """The positions of the session's cache in the store (None: it has none)."""
    store = ctx.engine.snapshots
    if store is None:
        return None
    found = await asyncio.to_thread(store.peek, store.session_key(tenant, session_id))
    return found[0] if found is not None else None
