"""Error bodies in the engine's shape ``{"error": {"code", "message", "type", "reason"}}``
(pure): a client sees the same shape whether the router or an engine refused it."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from polykv_api.models import REASONS, Reason

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "unavailable_error",
}


def error_body(status: int, reason: Reason, message: str, **extra: Any) -> dict[str, Any]:
    detail = {"code": status, "message": message, "type": TYPES.get(status, "server_error")}
    return {"error": {**detail, "reason": reason, **extra}}


def engine_reason(raw: bytes) -> str | None:
    """The ``reason`` of an engine error body, or None when it is not one."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    reason = err.get("reason") if isinstance(err, dict) else None
    return reason if isinstance(reason, str) else None


def retry_after_s(value: str | None) -> int | None:
    """A ``Retry-After`` in whole seconds (the engine sends integers), or None."""
    if value is None:
        return None
    try:
        return max(0, int(value.strip()))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Refusal:
    """One replica's refusal of a request: an engine 429 or an unavailable 503. The replica
    is for the router's own log and metrics, never for the client's answer."""

    replica: str
    status: int
    reason: str
    retry_after: int | None


def fleet_refusal(pool: str | None, refusals: list[Refusal]) -> tuple[int, dict[str, Any], int]:
    """The router's answer when every replica it tried refused: (status, body, Retry-After).

    Any 429 makes it a 429 with the smallest Retry-After among the 429s and that refusal's
    reason (the sooner a client may retry, the better); only 503s make it a 503."""
    limited = [r for r in refusals if r.status == 429]
    chosen = limited or refusals
    first = min(chosen, key=lambda r: r.retry_after if r.retry_after is not None else 1)
    retry = first.retry_after if first.retry_after is not None else 1
    what = f"pool {pool!r}" if pool is not None else "the fleet"
    # Reasons and counts only: which replicas exist is the operator's to know, not a client's.
    counts = Counter(r.reason for r in refusals)
    tried = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
    if limited:
        message = f"no replica can admit a new session in {what} ({tried})"
        reason: Reason = first.reason if first.reason in REASONS else "tps_floor"  # type: ignore[assignment]
        return 429, error_body(429, reason, message, pool=pool), retry
    message = f"no replica could serve the request ({tried})"
    return 503, error_body(503, "no_replica", message), retry
