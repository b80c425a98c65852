"""The aiohttp application: middlewares (errors, auth, metrics), routes, and lifecycle.

Graceful shutdown on SIGTERM/SIGINT: /health turns 503 at once (readiness fails, the
Service stops routing here), new requests get 503 + Retry-After, in-flight requests get up
to ``shutdown_timeout_s`` to finish, then the engine thread writes the sessions' caches
(``core.session_snapshots``, within its own deadline) and frees the model.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

from aiohttp import web

from polykv_api.limits import default_body_bytes
from polykv_engine.core import pool_ops
from polykv_engine.core.engine import Engine
from polykv_engine.http.admission_gate import AdmissionGate
from polykv_engine.http.app_context import APP_KEY, AppContext, ServerSettings
from polykv_engine.http.auth import auth_middleware
from polykv_engine.http.errors import BODY_LIMIT, DEFAULT_REASONS, ApiError
from polykv_engine.http.mailbox import loop_turns
from polykv_engine.http.metrics import (
    ComputeThreads,
    SnapshotCollector,
    build_registry,
    restore_histogram,
)
from polykv_engine.http.offload import WORKER, LargeStackExecutor
from polykv_engine.http.routes import inference, info, messages, pools, responses_api, snapshots

log = logging.getLogger("polykv.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

HTTP_COUNTER = web.AppKey("http_counter", object)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response(request.path)
    except web.HTTPRequestEntityTooLarge as exc:
        return ApiError(413, f"request body too large: {exc.text}").response(request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = (
            exc.reason if exc.status != 404 else f"no route for {request.method} {request.path}"
        )
        return ApiError(
            exc.status,
            message,
            headers={"Allow": exc.headers.get("Allow", "")} if exc.status == 405 else None,
            reason=DEFAULT_REASONS.get(exc.status, "invalid_request"),
        ).response(request.path)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        error = ApiError(500, "internal server error (logged)", "server_error")
        return error.response(request.path)


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    resp = await handler(request)
    route = request.match_info.route.resource
    template = route.canonical if route is not None else "unmatched"
    counter = request.app[HTTP_COUNTER]
    counter.labels(template, str(resp.status)).inc()  # type: ignore[attr-defined]
    return resp


def compute_threads(engine: Engine) -> ComputeThreads | None:
    rt = engine.runtime
    return None if rt is None else ComputeThreads(rt.n_threads, rt.omp_wait, rt.cpu_limit)


# Before the model has loaded with -c 0 the context size is unknown; bodies are refused with
# 503 then anyway, so any limit serves until the real one applies.
UNKNOWN_CTX = 131072


def body_limit(engine: Engine, settings: ServerSettings) -> int:
    """--polykv-max-body-bytes, else the default for this engine's context size."""
    if settings.max_body_bytes is not None:
        return settings.max_body_bytes
    rt = engine.runtime
    n_ctx = rt.n_ctx if rt is not None else engine.cfg.runtime.n_ctx
    return default_body_bytes(n_ctx or UNKNOWN_CTX)


KEPT_SWEEP_S = 1.0  # how often kept prefixes past their TTL are looked for


async def expire_kept_prefixes(engine: Engine) -> None:
    """Release kept prefixes whose TTL has passed (the engine thread is asked only when the
    published snapshot shows one)."""
    while True:
        await asyncio.sleep(KEPT_SWEEP_S)
        now = time.time()
        snap = engine.snapshot
        if any(p.owner is not None and p.kept_until <= now for p in snap.pools):
            n = await asyncio.wrap_future(engine.call(partial(pool_ops.expire_kept, now=now)))
            if n:
                log.info("released %d kept prefix(es) past their TTL", n)


def create_app(engine: Engine, settings: ServerSettings) -> web.Application:
    app = web.Application(
        middlewares=[metrics_middleware, error_middleware, auth_middleware],
        client_max_size=body_limit(engine, settings),  # for aiohttp's own reads
    )
    app[BODY_LIMIT] = lambda: body_limit(engine, settings)
    app[WORKER] = LargeStackExecutor()
    ctx = AppContext(engine=engine, settings=settings)
    app[APP_KEY] = ctx
    registry, http_counter = build_registry(
        lambda: engine.snapshot,
        lambda: ctx.pool_gauges,
        lambda: ctx.gate.autoscale() if ctx.gate is not None and engine.ready else (0.0, 0, 0, 0),
        lambda: compute_threads(engine),
    )
    registry.register(SnapshotCollector(lambda: engine.snapshots))
    ctx.restore_seconds = restore_histogram(registry)
    ctx.gate = AdmissionGate(engine, registry)
    app[info.METRICS_REGISTRY] = registry
    app[HTTP_COUNTER] = http_counter
    info.add_routes(app)
    inference.add_routes(app)
    messages.add_routes(app)
    responses_api.add_routes(app)
    pools.add_routes(app)
    snapshots.add_routes(app)

    async def start_gate(_: web.Application) -> None:
        ctx.gate.start()  # type: ignore[union-attr]

    async def stop_gate(_: web.Application) -> None:
        await ctx.gate.stop()  # type: ignore[union-attr]
        app[WORKER].shutdown(wait=False)

    async def sweep_kept(_: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(expire_kept_prefixes(engine))
        yield
        task.cancel()

    app.on_startup.append(start_gate)
    app.on_cleanup.append(stop_gate)
    app.cleanup_ctx.append(sweep_kept)
    return app


async def serve(
    engine: Engine, settings: ServerSettings, ready: asyncio.Event | None = None
) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    app = create_app(engine, settings)
    ctx = app[APP_KEY]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    log.info("listening on http://%s:%d", settings.host, settings.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine.arrival_barrier = loop_turns(loop)
    engine.start()
    await asyncio.to_thread(engine.wait_ready)
    if engine.load_error is not None:
        await runner.cleanup()
        return 1
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("shutting down: draining for up to %.0fs", settings.shutdown_timeout_s)
    ctx.draining = True
    deadline = time.monotonic() + settings.shutdown_timeout_s
    while time.monotonic() < deadline:
        snap = engine.snapshot  # lags a just-submitted task, hence in_flight too
        if ctx.in_flight == 0 and snap.n_processing == 0 and snap.n_waiting == 0:
            break
        await asyncio.sleep(0.1)
    await asyncio.to_thread(engine.stop)
    await runner.cleanup()
    log.info("stopped")
    return 0
