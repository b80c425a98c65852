"""API keys: inference routes need an API key, pool management needs the admin key; and
each request's identity (tenant, admin, router), resolved once here.

* ``--api-key`` set: every route but ``/health`` and ``/metrics`` needs it (or the admin key).
* no ``--api-key``: inference and read-only routes are open to whoever reaches the engine
  (llama-server's behaviour); mutating ``/polykv`` routes and slot erase still need the admin
  key when one is set, so agents never hold the key that deletes pools.
* every key is a tenant (``http.tenants``): a request sees its own tenant's sessions only;
  the admin key sees every tenant's.
* ``X-PolyKV-Router-Key`` matching ``--polykv-router-key`` marks a request as sent by the
  router, whose re-homed marker and ``overcommit`` are then honoured; it authenticates
  nothing by itself (the client's own key still has to pass).

``/health`` and ``/metrics`` stay open, as in llama-server: probes and scrapers carry no
secrets, and neither route exposes prompts or session ids.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from polykv_engine.http.app_context import APP_KEY, ServerSettings
from polykv_engine.http.errors import ApiError
from polykv_engine.http.tenants import (
    ADMIN_TENANT,
    OPEN_TENANT,
    Identity,
    key_matches,
    tenant_of,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/metrics"})
ROUTER_KEY_HEADER = "X-PolyKV-Router-Key"
IDENTITY = "polykv.identity"  # request key the middleware stores the Identity under


def presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("X-Api-Key")


def identify(request: web.Request, settings: ServerSettings) -> Identity:
    key = presented_key(request)
    tenant = tenant_of(key, settings.key_tenants)
    if tenant is None:
        tenant = ADMIN_TENANT if settings.api_keys else OPEN_TENANT
    # No admin key at all (an open engine): everyone may do what the admin may, as before.
    admin = not settings.admin_keys or key_matches(key, settings.admin_keys)
    router = bool(settings.router_keys) and key_matches(
        request.headers.get(ROUTER_KEY_HEADER), settings.router_keys
    )
    return Identity(tenant, admin, router)


def identity_of(request: web.Request) -> Identity:
    """The identity the middleware resolved (an open one for routes it did not see)."""
    found = request.get(IDENTITY)
    return found if isinstance(found, Identity) else Identity(OPEN_TENANT)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    settings = request.app[APP_KEY].settings
    if settings.api_keys and request.path not in PUBLIC_PATHS:
        keys = settings.api_keys + settings.admin_keys
        if not key_matches(presented_key(request), keys):
            raise ApiError(401, "Invalid API Key", "authentication_error")
    request[IDENTITY] = identify(request, settings)
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
