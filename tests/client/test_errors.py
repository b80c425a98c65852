"""The client's error mapping, pure: every reason code the engine can send has a typed
exception, a status alone is read only where it has one meaning, and the headers an agent
reads become typed signals."""

from __future__ import annotations

import httpx
import pytest

from polykv_api import models as wire
from polykv_client import (
    ERRORS,
    EngineUnavailable,
    PolyKVError,
    PoolNotFound,
    PoolSaturated,
    RequestRejected,
    Signals,
    error_from_response,
)


def test_every_reason_code_has_an_exception_class() -> None:
    assert set(ERRORS) == set(wire.REASONS)


@pytest.mark.parametrize("reason", wire.REASONS)
def test_each_code_maps_to_its_class_whatever_the_status_and_message(reason: str) -> None:
    cls = ERRORS[reason]  # type: ignore[index]
    status = 503 if issubclass(cls, EngineUnavailable) else 409
    body = {
        "error": {"code": status, "message": "pool already exists", "type": "x", "reason": reason}
    }
    exc = error_from_response(status, httpx.Headers({"Retry-After": "3"}), body)
    assert type(exc) is cls
    assert exc.reason == reason and exc.status == status and exc.retry_after == 3.0
    assert exc.message == "pool already exists"


def test_the_gate_refusal_names_its_pool_and_when_to_retry() -> None:
    body = {
        "error": {
            "code": 429,
            "message": "m",
            "type": "rate_limit_error",
            "reason": "context_headroom",
            "pool": "crew",
        }
    }
    exc = error_from_response(429, httpx.Headers({"retry-after": "2"}), body)
    assert isinstance(exc, PoolSaturated) and isinstance(exc, RequestRejected)
    assert exc.retry_after == 2.0 and exc.pool == "crew" and exc.reason == "context_headroom"


@pytest.mark.parametrize(
    ("status", "cls", "reason"),
    [
        (404, PoolNotFound, "pool_not_found"),
        (429, PoolSaturated, "tps_floor"),
        (409, RequestRejected, None),  # several meanings: no guess
        (503, EngineUnavailable, None),
        (500, EngineUnavailable, "internal"),
    ],
)
def test_an_engine_without_codes_is_read_by_status(
    status: int, cls: type[PolyKVError], reason: str | None
) -> None:
    body = {"error": {"code": status, "message": "m", "type": "t"}}
    exc = error_from_response(status, httpx.Headers(), body)
    assert type(exc) is cls and exc.reason == reason


def test_an_unknown_code_or_a_body_that_is_not_json() -> None:
    future = {"error": {"message": "m", "reason": "a_code_from_the_future"}}
    assert error_from_response(409, httpx.Headers(), future).reason is None
    exc = error_from_response(502, httpx.Headers(), "<html>bad gateway</html>")
    assert isinstance(exc, EngineUnavailable) and "bad gateway" in exc.message


def test_signals_from_headers() -> None:
    headers = httpx.Headers(
        {
            "x-session-id": "t1",
            "x-pool-id": "3",
            "x-cached-prefix-tokens": "40",
            "x-session-tps": "12.50",
            "X-PolyKV-Ctx-Headroom": "900",
            "x-polykv-compaction-pressure": "0.250",
            "X-Sessions-Remaining": "0",
        }
    )
    s = Signals.from_headers(headers)
    assert (s.session_id, s.pool_id, s.cached_prefix_tokens) == ("t1", 3, 40)
    assert (s.session_tps, s.ctx_headroom, s.compaction_pressure) == (12.5, 900, 0.25)
    assert s.sessions_remaining == 0 and s.backpressure
    bare = Signals.from_headers({"x-pool-id": "not a number"})
    assert bare.pool_id is None and not bare.backpressure
