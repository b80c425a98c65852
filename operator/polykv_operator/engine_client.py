"""HTTP client for one engine replica, typed with the wire contract (polykv_api.models).

Two kinds of failure, because the operator reacts differently: `EngineUnreachable` (no
answer, a timeout, a 5xx, still loading: try again later, never assume the pool is gone)
and `EngineRejected` (a 4xx, or a 5xx carrying one of the engine's refusal codes such as
`kv_full`, `queue_full` or `pools_disabled`: the engine answered and said no). A refusal carries the
engine's machine-readable `reason` (one of `polykv_api.models.Reason`); programs match that,
never the `message`, whose wording is for people and may change between engine versions.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar, cast

import httpx
from pydantic import BaseModel, ValidationError

from polykv_api import models as wire

from . import metrics

M = TypeVar("M", bound=BaseModel)

LIST_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
# Creating a pool waits for its prefill; a long prefix on a CPU takes a while.
CREATE_TIMEOUT = httpx.Timeout(120.0, connect=2.0)
# A dry run only renders and tokenizes: it holds a round up for no longer than this.
DRY_RUN_TIMEOUT = httpx.Timeout(30.0, connect=2.0)


class EngineError(Exception):
    pass


class EngineUnreachable(EngineError):
    """No usable answer; the replica's state is unknown."""


# What a status alone says, for an engine that sends no reason code (older than the codes):
# only statuses with one meaning on the routes the operator calls. A 409 has several.
STATUS_REASONS: dict[int, wire.Reason] = {
    400: "invalid_request",
    404: "pool_not_found",  # every route the operator calls names a pool
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


# A 5xx with one of these codes is an answer, not a failure to answer: the engine is up and
# refuses (503 kv_full / queue_full: busy now; 501 pools_disabled: never on this engine).
REFUSALS_5XX: frozenset[str] = frozenset({"kv_full", "queue_full", "pools_disabled"})


class EngineRejected(EngineError):
    """A 4xx answer: `status`, the engine's `reason` code, error `type` and `message`.

    `reason` is None only when the engine sent no known code and the status has more than
    one meaning (an older engine's 409)."""

    def __init__(self, status: int, message: str, etype: str, reason: str | None = None) -> None:
        super().__init__(f"{status} {etype}: {message}")
        self.status = status
        self.message = message
        self.type = etype
        self.reason: wire.Reason | None = (
            cast(wire.Reason, reason) if reason in wire.REASONS else STATUS_REASONS.get(status)
        )

    @property
    def not_found(self) -> bool:
        """The pool (or the parent named in the path) does not exist on this replica."""
        return self.reason == "pool_not_found"

    @property
    def capacity(self) -> bool:
        """No free pool sequence id: the engine holds as many pools as it can."""
        return self.reason == "seq_ids_exhausted"


class EngineClient:
    """Talks to the replica at `base_url` with the engine's admin key."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, admin_key: str | None) -> None:
        self.http = http
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    async def _call(
        self,
        method: str,
        path: str,
        model: type[M],
        body: BaseModel | None = None,
        timeout: httpx.Timeout = LIST_TIMEOUT,
        op: str = "other",
    ) -> M:
        t0 = time.monotonic()
        result = "error"
        payload = None if body is None else body.model_dump(mode="json", exclude_none=True)
        try:
            try:
                resp = await self.http.request(
                    method,
                    self.base_url + path,
                    json=payload,
                    headers=self.headers,
                    timeout=timeout,
                )
            except httpx.HTTPError as exc:
                raise EngineUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
            refusal = resp.status_code >= 500 and _error(resp)[2] in REFUSALS_5XX
            if (resp.status_code >= 500 and not refusal) or resp.status_code in (401, 403):
                # 401/403: our key is not (yet) the replica's; nothing we send can work.
                raise EngineUnreachable(f"HTTP {resp.status_code}: {_error(resp)[0]}")
            if resp.status_code >= 400:
                result = "rejected"
                raise EngineRejected(resp.status_code, *_error(resp))
            try:
                parsed = model.model_validate(resp.json())
            except (ValidationError, ValueError) as exc:
                raise EngineUnreachable(f"unexpected answer to {method} {path}: {exc}") from exc
            result = "ok"
            return parsed
        finally:
            metrics.ENGINE_CALLS.labels(op=op, result=result).observe(time.monotonic() - t0)

    async def list_pools(self) -> wire.PoolList:
        return await self._call("GET", "/polykv/pools", wire.PoolList, op="list")

    async def create(
        self, parent: str | None, req: wire.PoolCreateRequest | wire.PoolForkRequest
    ) -> wire.PoolCreated:
        """POST /polykv/pools for a root (`parent` None), else the fork route of `parent`."""
        path = "/polykv/pools" if parent is None else f"/polykv/pools/{parent}/fork"
        op = "dry_run" if req.dry_run else "create"
        timeout = DRY_RUN_TIMEOUT if req.dry_run else CREATE_TIMEOUT
        return await self._call("POST", path, wire.PoolCreated, req, timeout, op=op)

    async def release(self, ref: str) -> bool:
        """True when released now, False when the replica has no such pool."""
        try:
            await self._call("DELETE", f"/polykv/pools/{ref}", _Released, op="release")
        except EngineRejected as exc:
            if exc.not_found:
                return False
            raise
        return True

    async def evict(self, ref: str) -> wire.PoolStatus:
        """Drop the pool's KV but keep it: the next attach or fork re-materializes it."""
        return await self._call("POST", f"/polykv/pools/{ref}/evict", wire.PoolStatus, op="evict")

    async def set_admission(self, ref: str, policy: wire.AdmissionPolicy) -> wire.PoolStatus:
        return await self._call(
            "POST", f"/polykv/pools/{ref}/admission", wire.PoolStatus, policy, op="admission"
        )

    async def clear_admission(self, ref: str) -> wire.PoolStatus:
        return await self._call(
            "DELETE", f"/polykv/pools/{ref}/admission", wire.PoolStatus, op="admission"
        )


class _Released(BaseModel):
    released: int
    boot_id: str


def _json(resp: httpx.Response) -> dict[str, Any]:
    try:
        data = resp.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _error(resp: httpx.Response) -> tuple[str, str, str | None]:
    """(message, type, reason) of an error body; whatever the body lacks is filled in."""
    err = _json(resp).get("error")
    err = err if isinstance(err, dict) else {}
    message = str(err["message"]) if "message" in err else resp.text[:300] or resp.reason_phrase
    reason = err.get("reason")
    return message, str(err.get("type", "error")), reason if isinstance(reason, str) else None
