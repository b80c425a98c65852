"""Fetching a pool's KV snapshot from a peer replica of the same engine.

A scale-up replica asks a Ready one for the snapshot it would have written itself (same
model, build and layout: the same file name, ``GET /polykv/snapshots/{digest}`` with the
admin key). The body streams into a temporary file in this replica's store, never more
than the bound for the pool's length, with a progress line in the log; the store then
checks it like one of its own (header, key, sha256 of the payload) and keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import aiohttp

from polykv_engine.persist.fileformat import KVSnapshot, SnapshotRefused
from polykv_engine.persist.key import SnapshotKey
from polykv_engine.persist.store import SnapshotStore, private_file

log = logging.getLogger("polykv.snapshots")

CHUNK_BYTES = 1 << 20
PROGRESS_EVERY_BYTES = 64 << 20
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0  # a peer that sends nothing this long has stalled


async def fetch(
    store: SnapshotStore,
    peer: str,
    key: SnapshotKey,
    max_bytes: int,
    admin_key: str | None,
    what: str,
) -> KVSnapshot | None:
    """The peer's snapshot for ``key``, checked and kept in ``store``; None when the peer
    has none. ``SnapshotRefused`` ("peer_failed", "too_large", or what the checks find)."""
    url = f"{peer}/polykv/snapshots/{key.digest}"
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    tmp = store.incoming()
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, headers=headers, allow_redirects=False) as resp,
        ):
            if resp.status == 404:
                log.info("%s: peer %s has no snapshot of it", what, peer)
                return None
            if resp.status != 200:
                raise SnapshotRefused("peer_failed", f"{peer} answered {resp.status}")
            size = resp.content_length
            if size is None or size > max_bytes:
                raise SnapshotRefused(
                    "too_large", f"{peer} offers {size} bytes, more than the {max_bytes} accepted"
                )
            await _receive(resp, tmp, size, peer, what)
    except (aiohttp.ClientError, TimeoutError) as exc:
        store.refused("peer_failed")
        tmp.unlink(missing_ok=True)
        raise SnapshotRefused("peer_failed", f"{peer}: {exc or type(exc).__name__}") from exc
    except SnapshotRefused as exc:
        store.refused(exc.reason)
        tmp.unlink(missing_ok=True)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return await asyncio.to_thread(store.adopt, tmp, key, max_bytes, "peer")


async def _receive(
    resp: aiohttp.ClientResponse, tmp: Path, size: int, peer: str, what: str
) -> None:
    """Stream the body into ``tmp`` (writes off the event loop), exactly ``size`` bytes."""
    got, logged, t0 = 0, 0, time.perf_counter()
    with private_file(tmp) as f:
        async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
            got += len(chunk)
            if got > size:
                raise SnapshotRefused("peer_failed", f"{peer} sent more than its {size} bytes")
            await asyncio.to_thread(f.write, chunk)
            if got - logged >= PROGRESS_EVERY_BYTES:
                logged = got
                log.info(
                    "%s: %.0f of %.0f MiB from %s (%.0f%%, %.0f MiB/s)",
                    what,
                    got / 2**20,
                    size / 2**20,
                    peer,
                    100 * got / size,
                    got / 2**20 / max(time.perf_counter() - t0, 1e-9),
                )
    if got != size:
        raise SnapshotRefused("peer_failed", f"{peer} broke off after {got} of {size} bytes")
    log.info("%s: %.1f MiB from %s in %.2fs", what, size / 2**20, peer, time.perf_counter() - t0)
