"""The engine's refusals as typed exceptions, picked by the stable ``reason`` code.

Every error body the engine sends is ``{"error": {"code", "message", "type", "reason"}}``;
``reason`` is one of ``polykv_api.models.Reason`` and is the only thing programs should
match (the ``message`` is for people and may change between engine versions). An engine
older than the codes is read by its status alone, where the status has one meaning.

    PolyKVError                      status, reason, message, type, retry_after
    ├── EngineUnavailable            no usable answer: transport failure, 5xx, unreadable body
    └── RequestRejected              a 4xx: the engine understood the request and said no
        ├── AuthError                unauthorized, forbidden
        ├── InvalidRequest           the request itself is malformed or too large
        │   └── InvalidReference     a pool or session reference refused client-side
        ├── PoolNotFound             pool_not_found, snapshot_not_found
        ├── NameConflict             name_conflict
        ├── PrefixMismatch           prefix_mismatch, no_common_prefix, branch_pos_invalid
        ├── PrefixTooLong            prefix_too_long, prompt_too_long
        ├── HasChildren              has_children
        ├── SeqIdsExhausted          seq_ids_exhausted
        ├── PoolBusy                 pinned, in use, materializing, released, parent failed
        ├── PoolsDisabled            pools_disabled, not_supported, recurrent_branch/attach,
        │                            snapshots_disabled
        ├── SessionNotFound          session_not_found, slot_not_found, response_not_found
        ├── SessionBusy              session_empty, session_busy, slot_busy
        └── PoolSaturated            a 429 from the admission gate (tps_floor, kv_headroom,
                                     context_headroom, settling, prefill), with
                                     ``retry_after``
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

from polykv_api import models as wire


class PolyKVError(Exception):
    """An engine answer that is not a result. ``reason`` is the engine's stable code
    (None when it sent none and the status alone has several meanings); ``retry_after`` is
    the engine's ``Retry-After`` in seconds, when it sent one; ``body`` the error object."""

    def __init__(
        self,
        status: int | None,
        message: str,
        type: str = "error",
        reason: str | None = None,
        retry_after: float | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{status} {type}: {message}" if status is not None else message)
        self.status = status
        self.message = message
        self.type = type
        self.reason: wire.Reason | None = (
            cast(wire.Reason, reason) if reason in wire.REASONS else STATUS_REASONS.get(status or 0)
        )
        self.retry_after = retry_after
        self.body: Mapping[str, Any] = body or {}


class EngineUnavailable(PolyKVError):
    """No usable answer (connection refused, timeout, a 5xx, a body that is not the
    contract): the engine's state is unknown. Worth retrying after ``retry_after``."""


class RequestRejected(PolyKVError):
    """A 4xx: the engine understood the request and refused it; retrying it unchanged gets
    the same answer (a 429 excepted: see ``PoolSaturated``)."""


class AuthError(RequestRejected):
    """No key, or a key without the right: mutations need the admin key."""


class InvalidRequest(RequestRejected):
    """The request is malformed, names an unknown field, or is too large for the engine."""


class InvalidReference(InvalidRequest):
    """A pool or session reference the engine would refuse (or could not be sent in a URL
    path as it is), refused by the client before any request: ``status`` is None."""


class PoolNotFound(RequestRejected):
    """No pool by that id or name on this engine (or the parent a fork names), or no
    snapshot of a pool's prefix on the replica asked for it."""


class NameConflict(RequestRejected):
    """A pool of that name exists with a different prefix."""


class PrefixMismatch(RequestRejected):
    """A fork's prefix does not extend its parent's ``[0, branch_pos)`` token for token."""


class PrefixTooLong(RequestRejected):
    """The prefix or prompt does not fit the engine's context."""


class HasChildren(RequestRejected):
    """A pool with child pools cannot be released: release the children first."""


class SeqIdsExhausted(RequestRejected):
    """Every sequence id reserved for pools is in use (``--polykv-max-pools``)."""


class PoolBusy(RequestRejected):
    """The pool cannot do that now: pinned, in use, still materializing, or released."""


class PoolsDisabled(RequestRejected):
    """This engine serves no pools (``--polykv-max-pools 0``) or keeps no snapshots (no
    ``--polykv-snapshot-dir``), or its model cannot do what was asked (a branch or attach
    below a pool's length on a recurrent or hybrid model)."""


class SessionNotFound(RequestRejected):
    """No session (or slot) by that id on this engine, or the response a
    ``previous_response_id`` names is gone with its session."""


class SessionBusy(RequestRejected):
    """The session or slot holds nothing to snapshot, or is serving another request."""


class PoolSaturated(RequestRejected):
    """An enforced pool refused a NEW session (429): its projected tps would fall under the
    floor, or KV or context headroom is exhausted. Wait ``retry_after`` seconds, or send the
    turn as a continuation of a session the engine already knows."""

    @property
    def pool(self) -> str | None:
        """The refusing pool's label, from the error body (None when absent)."""
        pool = self.body.get("pool")
        return pool if isinstance(pool, str) else None


# What a status alone says, for an engine that sends no reason code: only statuses with one
# meaning on the pool and session routes. A 409 or a 503 has several.
STATUS_REASONS: dict[int, wire.Reason] = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "pool_not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    429: "tps_floor",
    500: "internal",
}

ERRORS: dict[wire.Reason, type[PolyKVError]] = {
    "invalid_request": InvalidRequest,
    "invalid_json": InvalidRequest,
    "unknown_fields": InvalidRequest,
    "unsupported_media_type": InvalidRequest,
    "body_too_large": InvalidRequest,
    "route_not_found": InvalidRequest,
    "method_not_allowed": InvalidRequest,
    "token_invalid": InvalidRequest,
    "template_error": InvalidRequest,
    "name_invalid": InvalidRequest,
    "json_too_deep": InvalidRequest,
    "grammar_too_large": InvalidRequest,
    "schema_too_large": InvalidRequest,
    "limit_exceeded": InvalidRequest,
    "prefix_empty": InvalidRequest,
    "prompt_too_long": PrefixTooLong,
    "prefix_too_long": PrefixTooLong,
    "not_supported": PoolsDisabled,
    "pools_disabled": PoolsDisabled,
    "unauthorized": AuthError,
    "forbidden": AuthError,
    "pool_not_found": PoolNotFound,
    "name_conflict": NameConflict,
    "prefix_mismatch": PrefixMismatch,
    "no_common_prefix": PrefixMismatch,
    "branch_pos_invalid": PrefixMismatch,
    # a recurrent state is exact only at a pool's end: the model cannot do what was asked
    "recurrent_branch": PoolsDisabled,
    "recurrent_attach": PoolsDisabled,
    "snapshots_disabled": PoolsDisabled,
    "snapshot_not_found": PoolNotFound,
    "seq_ids_exhausted": SeqIdsExhausted,
    "has_children": HasChildren,
    "pool_pinned": PoolBusy,
    "pool_in_use": PoolBusy,
    "pool_materializing": PoolBusy,
    "pool_released": PoolBusy,
    "parent_failed": PoolBusy,
    "session_not_found": SessionNotFound,
    "slot_not_found": SessionNotFound,
    "response_not_found": SessionNotFound,
    "session_empty": SessionBusy,
    "session_busy": SessionBusy,
    "slot_busy": SessionBusy,
    "tps_floor": PoolSaturated,
    "kv_headroom": PoolSaturated,
    "context_headroom": PoolSaturated,
    "settling": PoolSaturated,
    "prefill": PoolSaturated,
    "kv_full": EngineUnavailable,
    "queue_full": EngineUnavailable,
    "no_replica": EngineUnavailable,
    "loading": EngineUnavailable,
    "shutting_down": EngineUnavailable,
    "decode_failed": EngineUnavailable,
    "internal": EngineUnavailable,
}
"""The exception class for each reason code (every code has one; a test checks)."""


def error_class(status: int, reason: wire.Reason | None) -> type[PolyKVError]:
    """The class for a refusal: by its code, else by its status class."""
    if reason is not None:
        return ERRORS[reason]
    if status >= 500:
        return EngineUnavailable
    return RequestRejected


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """``Retry-After`` in seconds (the engine sends whole seconds; a date form is ignored)."""
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None


def error_from_response(status: int, headers: Mapping[str, str], body: Any) -> PolyKVError:
    """The typed exception for an error answer. ``headers`` must look names up without
    regard to case (``httpx.Headers`` does); ``body`` is the parsed JSON, or its text."""
    if isinstance(body, str | bytes):
        try:
            body = json.loads(body)
        except ValueError:
            body = {"error": {"message": body[:300] if isinstance(body, str) else ""}}
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    message = str(err.get("message") or f"HTTP {status}")
    raw_reason = err.get("reason")
    code = raw_reason if isinstance(raw_reason, str) and raw_reason in wire.REASONS else None
    reason = cast(wire.Reason | None, code) or STATUS_REASONS.get(status)
    cls = error_class(status, reason)
    etype = str(err.get("type", "error"))
    return cls(status, message, etype, reason, retry_after_s(headers), err)
