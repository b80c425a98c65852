"""API keys: inference routes need an API key, pool management needs the admin key.

* ``--api-key`` set: every route but ``/health`` and ``/metrics`` needs it (or the admin key).
* no ``--api-key``: inference and read-only routes are open to whoever reaches the engine
  (llama-server's behaviour); mutating ``/polykv`` routes and slot erase still need the admin
  key when one is set, so agents never hold the key that deletes pools.

``/health`` and ``/metrics`` stay open, as in llama-server: probes and scrapers carry no
secrets, and neither route exposes prompts or session ids.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from polykv_engine.http.app_context import APP_KEY
from polykv_engine.http.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/metrics"})


def presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("X-Api-Key")


def key_matches(presented: str | None, keys: tuple[str, ...]) -> bool:
    if presented is None:
        return False
    return any(hmac.compare_digest(presented.encode(), k.encode()) for k in keys)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    settings = request.app[APP_KEY].settings
    if settings.api_keys and request.path not in PUBLIC_PATHS:
        keys = settings.api_keys + settings.admin_keys
        if not key_matches(presented_key(request), keys):
            raise ApiError(401, "Invalid API Key", "authentication_error")
    return await handler(request)


def require_admin(request: web.Request) -> None:
    """Mutating /polykv routes: the admin key, not merely an inference key."""
    settings = request.app[APP_KEY].settings
    if not settings.admin_keys:
        return
    key = presented_key(request)
    if key_matches(key, settings.admin_keys):
        return
    if key_matches(key, settings.api_keys):
        raise ApiError(
            403,
            "this key may run inference but not manage pools; use the admin key",
            "permission_error",
        )
    raise ApiError(401, "Invalid API Key", "authentication_error")
