"""Errors in llama-server's JSON shape, plus a stable code for programs:
``{"error": {"code", "message", "type", "reason"}}``. Clients match ``reason`` (listed in
``polykv_api.models.Reason``), never the message text."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
from aiohttp import web
from pydantic import BaseModel, ValidationError

from polykv_api.limits import MAX_JSON_DEPTH
from polykv_api.models import Reason
from polykv_engine.http.offload import offload

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}

# The reason an error carries when the raiser names none: only statuses with one meaning.
DEFAULT_REASONS: dict[int, Reason] = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "route_not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    500: "internal",
    501: "not_supported",
}

# Anthropic's error types by status (its API reference); 503 is how this engine says
# "overloaded" (a full queue, shutting down, loading).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)  # routes whose errors take Anthropic's shape

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """Raised by handlers; the error middleware turns it into a JSON response."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
        reason: Reason | None = None,
    ) -> None:
        super().__init__(message)
        if reason is None:
            if status not in DEFAULT_REASONS:
                raise ValueError(f"an HTTP {status} error must name its reason")
            reason = DEFAULT_REASONS[status]
        self.status = status
        self.message = message
        self.type = type_ or TYPES.get(status, "server_error")
        self.reason: Reason = reason
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        detail = {"code": self.status, "message": self.message, "type": self.type}
        return {"error": {**detail, "reason": self.reason, **self.extra}}

    def response(self, path: str = "") -> web.Response:
        """The error as an HTTP response, in the shape of the API ``path`` belongs to."""
        body = anthropic_error(self) if path.startswith(ANTHROPIC_PATHS) else self.body()
        return web.json_response(body, status=self.status, headers=self.headers)


def anthropic_error(exc: ApiError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``, plus PolyKV's ``reason``."""
    fallback = "api_error" if exc.status >= 500 else "invalid_request_error"
    kind = ANTHROPIC_TYPES.get(exc.status, fallback)
    return {
        "type": "error",
        "error": {"type": kind, "message": exc.message, "reason": exc.reason, **exc.extra},
    }


def validation_message(exc: ValidationError) -> str:
    """One line naming every offending field, e.g. ``temperature: must be >= 0``."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


# The body limit in bytes, asked per request: the derived default depends on the context
# size, known once the model has loaded (http.app sets it).
BODY_LIMIT: web.AppKey[Callable[[], int]] = web.AppKey("polykv_body_limit")
BODY_BYTES = "polykv.body_bytes"  # request key: how many bytes the body had (offload sizes)


def body_bytes(request: web.Request) -> int:
    """The body's size: what decides whether its preparation leaves the event loop."""
    return int(request.get(BODY_BYTES, 0))


READ_CHUNK = 1 << 16


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body is over the limit of {limit} bytes (--polykv-max-body-bytes; by "
        "default 64 bytes per context token + 2 MiB)",
        reason="body_too_large",
    )


async def read_body(request: web.Request) -> bytes:
    """The whole body, refused with 413 before it is read when Content-Length is over the
    limit, and as soon as a body without one (chunked) passes it."""
    limit = request.app[BODY_LIMIT]()
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.read(READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    raw = b"".join(parts)
    request[BODY_BYTES] = len(raw)
    return raw


# Strings (their brackets are text) and everything but brackets, removed in C: what is
# left is the nesting, measured without recursion however deep it goes.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_OPEN = np.zeros(256, np.int8)
_OPEN[list(b"[{")] = 1
_OPEN[list(b"]}")] = -1
_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in the JSON text ``raw`` (strings skipped)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_OPEN[np.frombuffer(brackets, np.uint8)], dtype=np.int64).max())


def _not_json_number(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of the range of a double")
    return value


def decode_json(raw: bytes) -> dict[str, Any]:
    """A body's bytes as a JSON object, or a 400 that says what is wrong with them. Checks
    the nesting first, so no parser recurses past ``MAX_JSON_DEPTH``."""
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object", reason="invalid_json")
    # Fewer brackets than the limit cannot nest past it (counted in C, no scan needed).
    few = raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH
    depth = 0 if few else json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(
            400,
            f"request body: arrays and objects nest {depth} deep, the limit is {MAX_JSON_DEPTH}",
            reason="json_too_deep",
        )
    try:
        body = json.loads(raw, parse_constant=_not_json_number, parse_float=_finite)
        if _LONE_SURROGATE.search(raw):  # text that is no Unicode cannot be tokenized
            json.dumps(body, ensure_ascii=False).encode()
    except (ValueError, RecursionError) as exc:  # ValueError: also 5000-digit integers
        raise ApiError(
            400, f"request body is not valid JSON: {exc}", reason="invalid_json"
        ) from exc
    if not isinstance(body, dict):
        raise ApiError(
            400,
            f"request body must be a JSON object, got {type(body).__name__}",
            reason="invalid_json",
        )
    return body


def _check_content_type(request: web.Request) -> None:
    """A body declared as something else than JSON is a 415 (no Content-Type at all is
    taken as JSON)."""
    declared = request.headers.get("Content-Type")
    if declared is not None:
        mime = request.content_type
        if mime != "application/json" and not mime.endswith("+json"):
            raise ApiError(
                415,
                f"Content-Type {mime!r} is not JSON; send the body as application/json",
            )


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it (a 415
    for another declared type, a 413 past the body limit). A large body is decoded off the
    event loop."""
    _check_content_type(request)
    raw = await read_body(request)
    return await offload(request, len(raw), decode_json, raw)


def validate(body: dict[str, Any], model: type[M]) -> M:
    """A decoded body validated against a wire model; a 400 naming every bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        unknown = [
            ".".join(map(str, e["loc"])) for e in exc.errors() if e["type"] == "extra_forbidden"
        ]
        reason: Reason = (
            "unknown_fields" if unknown and len(unknown) == len(exc.errors()) else "invalid_request"
        )
        raise ApiError(400, validation_message(exc), reason=reason) from exc


def _decode_and_validate(raw: bytes, model: type[M]) -> M:
    return validate(decode_json(raw), model)


async def parse(request: web.Request, model: type[M]) -> M:
    """The JSON body validated against a wire model; a 400 naming every bad field. A large
    body is decoded and validated off the event loop."""
    _check_content_type(request)
    raw = await read_body(request)
    return await offload(request, len(raw), _decode_and_validate, raw, model)
