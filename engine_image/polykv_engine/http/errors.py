"""Errors in llama-server's JSON shape, plus a stable code for programs:
``{"error": {"code", "message", "type", "reason"}}``. Clients match ``reason`` (listed in
``polykv_api.models.Reason``), never the message text."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from polykv_api.models import Reason

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

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def validation_message(exc: ValidationError) -> str:
    """One line naming every offending field, e.g. ``temperature: must be >= 0``."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it. A body
    declared as something else than JSON is a 415 (no Content-Type at all is taken as JSON)."""
    declared = request.headers.get("Content-Type")
    if declared is not None:
        mime = request.content_type
        if mime != "application/json" and not mime.endswith("+json"):
            raise ApiError(
                415,
                f"Content-Type {mime!r} is not JSON; send the body as application/json",
            )
    raw = await request.read()
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object", reason="invalid_json")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
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


async def parse(request: web.Request, model: type[M]) -> M:
    """The JSON body validated against a wire model; a 400 naming every bad field."""
    body = await read_json(request)
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
