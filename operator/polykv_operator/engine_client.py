"""HTTP client for one engine replica, typed with the wire contract (polykv_api.models).

Two kinds of failure, because the operator reacts differently: `EngineUnreachable` (no
answer, a timeout, a 5xx, still loading: try again later, never assume the pool is gone)
and `EngineRejected` (a 4xx: the engine understood and said no; the message says why).
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from polykv_api import models as wire

from . import metrics

M = TypeVar("M", bound=BaseModel)

LIST_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
# Creating a pool waits for its prefill; a long prefix on a CPU takes a while.
CREATE_TIMEOUT = httpx.Timeout(120.0, connect=2.0)


class EngineError(Exception):
    pass


class EngineUnreachable(EngineError):
    """No usable answer; the replica's state is unknown."""


class EngineRejected(EngineError):
    """A 4xx answer: `status`, the engine's error `type` and `message`."""

    def __init__(self, status: int, message: str, etype: str) -> None:
        super().__init__(f"{status} {etype}: {message}")
        self.status = status
        self.message = message
        self.type = etype

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def capacity(self) -> bool:
        return self.type == "capacity_error"


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
            if resp.status_code >= 500 or resp.status_code in (401, 403):
                # 401/403: our key is not (yet) the replica's; nothing we send can work.
                raise EngineUnreachable(f"HTTP {resp.status_code}: {_message(resp)}")
            if resp.status_code >= 400:
                result = "rejected"
                raise EngineRejected(resp.status_code, _message(resp), _etype(resp))
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
        return await self._call("POST", path, wire.PoolCreated, req, CREATE_TIMEOUT, op=op)

    async def release(self, ref: str) -> bool:
        """True when released now, False when the replica has no such pool."""
        try:
            await self._call("DELETE", f"/polykv/pools/{ref}", _Released, op="release")
        except EngineRejected as exc:
            if exc.not_found:
                return False
            raise
        return True

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


def _message(resp: httpx.Response) -> str:
    err = _json(resp).get("error")
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])
    return resp.text[:300] or resp.reason_phrase


def _etype(resp: httpx.Response) -> str:
    err = _json(resp).get("error")
    if isinstance(err, dict) and "type" in err:
        return str(err["type"])
    return "error"
