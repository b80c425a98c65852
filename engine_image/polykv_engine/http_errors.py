"""Errors in llama-server's JSON shape: ``{"error": {"code", "message", "type"}}``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from pydantic import ValidationError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class ApiError(Exception):
    """Raised by handlers; the error middleware turns it into a JSON response."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or TYPES.get(status, "server_error")
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}
        }

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
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    raw = await request.read()
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body
