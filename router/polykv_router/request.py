"""What the router reads from a request: the session and the pool, validated (pure).

The router reads only these two fields and leaves the rest of the body to the engine, which
validates it. Precedence follows the engine: the body's ``session_id`` wins over the
``x-session-id`` header, and ``pool_id`` over its legacy alias ``shared_pool_slot``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from polykv_api.models import Reason

from .names import MAX_SESSION_ID, SESSION_HEADER


class RequestError(Exception):
    """A request the router refuses before routing it (answered in the engine's error shape)."""

    def __init__(self, status: int, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason: Reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class RoutingKey:
    session: str | None
    """The continuation key, or None for a one-shot request (placed, never bound)."""
    pool: str | None
    """The pool reference as the client wrote it (a name, or a per-replica id), or None."""
    parent: str | None = None
    """The parent session of a sub-agent (its first request goes where the parent is)."""


def _session(header: str | None, doc: dict[str, Any]) -> str | None:
    if "session_id" in doc and doc["session_id"] is not None:
        value = doc["session_id"]
        if not isinstance(value, str) or not value:
            raise RequestError(400, "invalid_request", "session_id: must be a non-empty string")
        if len(value) > MAX_SESSION_ID:
            raise RequestError(
                400, "invalid_request", f"session_id: at most {MAX_SESSION_ID} characters"
            )
        return value
    if header is not None and len(header) > MAX_SESSION_ID:
        raise RequestError(
            400, "invalid_request", f"{SESSION_HEADER}: at most {MAX_SESSION_ID} characters"
        )
    return header or None


def _pool(doc: dict[str, Any]) -> str | None:
    pool = doc.get("pool_id")
    if pool is not None:
        # bool is an int in Python; the engine's schema refuses it, and so do we.
        if isinstance(pool, bool) or not isinstance(pool, int | str) or pool == "":
            raise RequestError(400, "invalid_request", "pool_id: must be a pool name or id")
        return str(pool)
    slot = doc.get("shared_pool_slot")
    if slot is not None:
        if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
            raise RequestError(400, "invalid_request", "shared_pool_slot: must be an integer >= 0")
        return str(slot)
    return None


def routing_key(header_session: str | None, body: bytes, parent: str | None = None) -> RoutingKey:
    """The session and pool of an inference request; RequestError when they are malformed.
    A Responses request without a session is keyed by its ``prompt_cache_key``, as the
    engine keys it."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RequestError(400, "invalid_request", "request body must be a JSON object")
    session = _session(header_session, doc)
    cache_key = doc.get("prompt_cache_key")
    if session is None and isinstance(cache_key, str) and 0 < len(cache_key) <= MAX_SESSION_ID:
        session = cache_key
    return RoutingKey(session, _pool(doc), parent)
