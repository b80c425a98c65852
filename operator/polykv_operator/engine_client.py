"""The operator's view of one engine replica, over the shared client (``polykv_client``).

Two kinds of failure, because the operator reacts differently: `EngineUnreachable` (no
answer, a timeout, a 5xx, still loading, or our admin key not yet the replica's: try again
later, never assume the pool is gone) and `EngineRejected` (a 4xx, or a 5xx carrying one of
the engine's refusal codes such as `kv_full`, `queue_full` or `pools_disabled`: the engine
answered and said no). A refusal carries the engine's machine-readable `reason` (one of
`polykv_api.models.Reason`); programs match that, never the `message`, whose wording is for
people and may change between engine versions. Every call is timed in the operator's
metrics by operation and result.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TypeVar

import httpx
from opentelemetry import propagate

import polykv_client
from polykv_api import models as wire
from polykv_client import (
    AsyncPolyKVClient,
    AuthError,
    EngineUnavailable,
    PoolNotFound,
    Revalidated,
)

from . import metrics

T = TypeVar("T")

LIST_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
# Creating a pool waits for its prefill; a long prefix on a CPU takes a while.
CREATE_TIMEOUT = httpx.Timeout(120.0, connect=2.0)
# A dry run only renders and tokenizes: it holds a round up for no longer than this.
DRY_RUN_TIMEOUT = httpx.Timeout(30.0, connect=2.0)

EngineRejected = polykv_client.RequestRejected
"""A refusal: `status`, the engine's `reason` code, error `type` and `message`. `reason` is
None only when the engine sent no known code and the status has more than one meaning (an
older engine's 409)."""

# A 5xx with one of these codes is an answer, not a failure to answer: the engine is up and
# refuses (503 kv_full / queue_full: busy now; 501 pools_disabled: never on this engine).
REFUSALS_5XX: frozenset[str] = frozenset({"kv_full", "queue_full", "pools_disabled"})


async def _carry_trace(request: httpx.Request) -> None:
    """The current span (an operator round's) goes with the call as W3C ``traceparent``, so
    the engine's side joins the round's trace; nothing is added while tracing is off."""
    propagate.inject(request.headers)


def engine_http(transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The one HTTP client for every replica (``transport``: tests' stand-in engines)."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=64),
        event_hooks={"request": [_carry_trace]},
        transport=transport,
    )


class EngineUnreachable(Exception):
    """No usable answer; the replica's state is unknown."""


class EngineClient:
    """Talks to the replica at `base_url` with the engine's admin key."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, admin_key: str | None) -> None:
        self.api = AsyncPolyKVClient(
            base_url,
            admin_key=admin_key,
            timeout=LIST_TIMEOUT,
            create_timeout=CREATE_TIMEOUT,
            http=http,
        )
        # The same replica for dry runs, whose "slow" calls get the shorter timeout.
        self.dry = AsyncPolyKVClient(
            base_url,
            admin_key=admin_key,
            timeout=LIST_TIMEOUT,
            create_timeout=DRY_RUN_TIMEOUT,
            http=http,
        )

    async def _timed(self, op: str, call: Awaitable[T]) -> T:
        t0 = time.monotonic()
        result = "error"
        try:
            try:
                value = await call
            except EngineUnavailable as exc:
                if exc.reason in REFUSALS_5XX and exc.status is not None:
                    result = "rejected"
                    raise EngineRejected(
                        exc.status, exc.message, exc.type, exc.reason, exc.retry_after, exc.body
                    ) from exc
                raise EngineUnreachable(str(exc)) from exc
            except AuthError as exc:
                # 401/403: our key is not (yet) the replica's; nothing we send can work.
                raise EngineUnreachable(str(exc)) from exc
            except EngineRejected:
                result = "rejected"
                raise
            result = "ok"
            return value
        finally:
            metrics.ENGINE_CALLS.labels(op=op, result=result).observe(time.monotonic() - t0)

    async def list_pools(self, etag: str | None = None) -> Revalidated:
        """The replica's listing; with the ETag of the one held, None when unchanged."""
        return await self._timed("list", self.api.list_pools_if_changed(etag))

    async def create(
        self, parent: str | None, req: wire.PoolCreateRequest | wire.PoolForkRequest
    ) -> wire.PoolCreated:
        """POST /polykv/pools for a root (`parent` None), else the fork route of `parent`."""
        op = "dry_run" if req.dry_run else "create"
        api = self.dry if req.dry_run else self.api
        if parent is None:
            return await self._timed(op, api.create_pool(req))
        return await self._timed(op, api.fork_pool(parent, req))

    async def release(self, ref: str) -> bool:
        """True when released now, False when the replica has no such pool."""
        try:
            await self._timed("release", self.api.release(ref))
        except PoolNotFound:
            return False
        return True

    async def evict(self, ref: str) -> wire.PoolStatus:
        """Drop the pool's KV but keep it: the next attach or fork re-materializes it."""
        return await self._timed("evict", self.api.pool_action(ref, "evict"))

    async def set_admission(self, ref: str, policy: wire.AdmissionPolicy) -> wire.PoolStatus:
        return await self._timed("admission", self.api.set_admission(ref, policy))

    async def clear_admission(self, ref: str) -> wire.PoolStatus:
        return await self._timed("admission", self.api.clear_admission(ref))
