"""The aiohttp application: routes, error shape, health, metrics, and the background tasks
(pod watch, capacity poll, binding expiry). Wiring only; the request path is routing.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import __version__
from .bindings import Bindings
from .capacity import CapacityPoller
from .config import Config
from .engines import Engines
from .errors import error_body
from .fleet import Fleet
from .keycheck import KeyCheck
from .kube import InCluster, PodWatch
from .metrics import Metrics, State
from .names import INFERENCE_PATHS, PASSTHROUGH_GET, PASSTHROUGH_POST
from .pods import Pod
from .proxy import Proxy
from .request import RequestError
from .reservations import Reservations
from .routing import Router
from .verdicts import KeyVerdicts

log = logging.getLogger("polykv.router")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SWEEP_S = 60.0
# What the client library adds on its own: a proxy must send only what the client sent.
NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


class RouterApp:
    """Owns the state, the HTTP clients and the background tasks of one router process."""

    def __init__(self, cfg: Config, env: Mapping[str, str]) -> None:
        self.cfg = cfg
        self.env = env
        self.fleet = Fleet()
        self.bindings = Bindings(cfg.session_ttl_s, cfg.max_sessions)
        self.reservations = Reservations(cfg.reservation_max_age_s)
        self.verdicts = KeyVerdicts(cfg.key_cache_size, cfg.key_ttl_s, cfg.key_refused_ttl_s)
        self.metrics = Metrics()
        self.metrics.add_state(self._state)
        self._poller: CapacityPoller | None = None
        self.watch: PodWatch | None = None
        self._router: Router | None = None
        self._clients: list[aiohttp.ClientSession] = []
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def router(self) -> Router:
        if self._router is None:
            raise web.HTTPServiceUnavailable(text="starting")
        return self._router

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors_and_counts]
        )
        for path in INFERENCE_PATHS:
            app.router.add_post(path, self._inference)
        for path in PASSTHROUGH_GET:
            app.router.add_get(path, self._passthrough)
        for path in PASSTHROUGH_POST:
            app.router.add_post(path, self._passthrough)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    # ------------------------------------------------------------------ lifecycle

    async def _start(self, _: web.Application) -> None:
        cfg = self.cfg
        upstream = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,
            skip_auto_headers=NO_AUTO_HEADERS,
        )
        self._clients.append(upstream)
        engines = Engines(upstream, cfg.engine_api_key, cfg.lookup_timeout_s, cfg.router_key)
        poller = CapacityPoller(
            self.fleet,
            engines,
            self.reservations,
            cfg.poll_interval_s,
            cfg.pool_idle_s,
            cfg.max_polled_pools,
        )
        self._poller = poller
        self._router = Router(
            cfg,
            self.fleet,
            self.bindings,
            self.reservations,
            poller,
            engines,
            Proxy(upstream, cfg.connect_timeout_s, cfg.router_key),
            self.metrics,
            KeyCheck(self.fleet, engines, self.verdicts, self.metrics),
        )
        if cfg.static:
            self.fleet.replace(
                Pod(r.name, r.name, r.host, r.port, ready=True, terminating=False)
                for r in cfg.static
            )
        else:
            assert cfg.selector is not None
            creds = InCluster.load(cfg.serviceaccount_dir, self.env, cfg.namespace)
            kube_http = aiohttp.ClientSession()
            self._clients.append(kube_http)
            self.watch = PodWatch(creds, cfg.selector, cfg.engine_port, self.fleet, kube_http)
            self._spawn(self.watch.run())
        self._spawn(poller.run())
        self._spawn(self._sweep())
        log.info(
            "polykv-router started",
            extra={"fields": {"version": __version__, "port": cfg.port, "selector": cfg.selector,
                              "namespace": self.watch.creds.namespace if self.watch else None,
                              "static": [r.name for r in cfg.static]}},
        )  # fmt: skip

    def _state(self) -> State:
        pools = len(self._poller.hot) if self._poller is not None else 0
        return State(len(self.bindings), self.fleet.counts(), pools, len(self.verdicts))

    def _spawn(self, coro: Awaitable[None]) -> None:
        self._tasks.append(asyncio.ensure_future(coro))

    async def _stop(self, _: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for client in self._clients:
            await client.close()

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            n = self.bindings.expire(loop.time())
            if n:
                log.info("idle sessions forgotten", extra={"fields": {"sessions": n}})

    # ------------------------------------------------------------------ handlers

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        return await self.router.inference(request)

    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        return await self.router.passthrough(request)

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _: web.Request) -> web.Response:
        synced = self.cfg.static or (self.watch is not None and self.watch.synced)
        counts = self.fleet.counts()
        body = {"status": "ok" if synced else "syncing", "replicas": counts}
        return web.json_response(body, status=200 if synced else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @web.middleware
    async def _errors_and_counts(
        self, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        try:
            resp = await handler(request)
        except RequestError as exc:
            resp = web.json_response(
                error_body(exc.status, exc.reason, exc.message), status=exc.status
            )
        except web.HTTPRequestEntityTooLarge as exc:
            resp = web.json_response(
                error_body(413, "body_too_large", exc.text or "body too large"), status=413
            )
        except web.HTTPMethodNotAllowed as exc:
            msg = f"{request.method} is not allowed on {request.path}"
            resp = web.json_response(
                error_body(405, "method_not_allowed", msg),
                status=405,
                headers={"Allow": ",".join(sorted(exc.allowed_methods))},
            )
        except web.HTTPNotFound:
            msg = f"{request.path} is not a route of polykv-router (inference and info routes only)"
            resp = web.json_response(error_body(404, "route_not_found", msg), status=404)
        self.metrics.requests.labels(route, str(resp.status)).inc()
        return resp
