"""The HTTP servers of the autoscaling signal, on the operator's event loop.

- JSON (plain HTTP), for KEDA's metrics-api scaler: `GET /polykv/autoscale/{ns}/{engine}`
  (report.py) and `/healthz`.
- The external.metrics.k8s.io API (HTTPS, opt-in), behind an APIService: discovery, the
  metric values (external_metrics.py), minimal OpenAPI documents and `/healthz`. Only the
  aggregator may call it: every request but `/healthz` must carry a client certificate that
  chains to the front-proxy CA and has an allowed common name (tls.py); 401 otherwise.

Both read the signal at request time from `SignalSource` (the fleet's last polls), so a
figure is never older than the staleness limit allows.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from . import external_metrics as em
from . import report
from .aggregate import Signal
from .apiservice import verdict
from .tls import AUTH_CONFIGMAP, FrontProxy, server_context

log = logging.getLogger("polykv.operator.autoscale")

SignalSource = Callable[[str, str], Signal | None]
"""(namespace, engine) -> its signal now; None: the operator has not polled such an engine."""
Getter = Callable[[str], Awaitable[dict[str, Any] | None]]
"""GET an API path with the operator's credentials; None when it is not there (404)."""
CaSetter = Callable[[str, str], Awaitable[None]]
"""Sets an APIService's (name) caBundle (base64 PEM) with the operator's credentials."""

APISERVICES = "/apis/apiregistration.k8s.io/v1/apiservices/"
CA_BUNDLE_EVERY_S = 10.0  # how often the APIService's caBundle is looked at (one GET)


def _json(status: int, body: Any) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


def json_app(source: SignalSource, clock: Callable[[], float] = time.time) -> web.Application:
    async def autoscale(request: web.Request) -> web.Response:
        parsed = report.parse_path(request.path)
        if parsed is None:
            return _json(404, {"error": "use /polykv/autoscale/{namespace}/{engine}"})
        namespace, engine = parsed
        signal = source(namespace, engine)
        status, body = (
            report.not_found(namespace, engine)
            if signal is None
            else report.document(namespace, engine, signal, clock())
        )
        return _json(status, body)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get(report.PREFIX + "{tail:.*}", autoscale)
    return app


def external_app(source: SignalSource, front_proxy: FrontProxy) -> web.Application:
    @web.middleware
    async def aggregator_only(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path == "/healthz":
            return await handler(request)
        transport = request.transport
        peercert = transport.get_extra_info("peercert") if transport is not None else None
        if not front_proxy.admits(peercert):
            log.warning(
                "external metrics request refused (no front-proxy client certificate) "
                "path=%s peer=%s",
                request.path,
                request.remote,
            )
            err = em.ApiError(401, "Unauthorized", "a front-proxy client certificate is required")
            return _json(401, em.status(err))
        try:
            return await handler(request)
        except em.ApiError as err:
            return _json(err.code, em.status(err))

    async def discovery(_: web.Request) -> web.Response:
        return _json(200, em.resource_list())

    async def value(request: web.Request) -> web.Response:
        namespace, metric = em.parse_path(request.path)
        engine = em.engine_of(request.query.get("labelSelector"))
        req = em.MetricRequest(namespace, metric, engine)
        body = em.value_list(req, source(namespace, engine))
        log.debug("external metric ns=%s engine=%s %s", namespace, engine, body["items"][0])
        return _json(200, body)

    async def openapi_v2(_: web.Request) -> web.Response:
        return _json(200, em.openapi_v2())

    async def openapi_v3(_: web.Request) -> web.Response:
        return _json(200, em.openapi_v3())

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def unknown(request: web.Request) -> web.Response:
        raise em.ApiError(404, "NotFound", f"no such path: {request.path}")

    app = web.Application(middlewares=[aggregator_only])
    app.router.add_get("/healthz", healthz)
    app.router.add_get(em.ROOT, discovery)
    app.router.add_get(em.ROOT + "/", discovery)
    app.router.add_get(em.ROOT + "/namespaces/{namespace}/{metric}", value)
    app.router.add_get("/openapi/v2", openapi_v2)
    app.router.add_get("/openapi/v3", openapi_v3)
    app.router.add_route("*", "/{tail:.*}", unknown)
    return app


@dataclass(frozen=True)
class ExternalSettings:
    address: str
    port: int
    cert_file: Path
    key_file: Path
    service_namespace: str  # the Service our APIService must point at
    service_name: str
    ca_file: Path | None = None  # the serving certificate's CA, for the APIService's caBundle


async def keep_ca_bundle(
    settings: ExternalSettings, get: Getter, set_ca: CaSetter, every_s: float = CA_BUNDLE_EVERY_S
) -> None:
    """Keeps our APIService's caBundle equal to the serving certificate's CA, for as long as
    the operator runs. The chart renders the APIService without one (a CA in the rendered
    chart would change at every `helm template`); a `helm upgrade` from a layout that
    rendered one takes it away, and this puts it back. Someone else's APIService is never
    touched (`verdict`)."""
    assert settings.ca_file is not None
    want = base64.b64encode(settings.ca_file.read_bytes()).decode()
    while True:
        try:
            found = await get(APISERVICES + em.APISERVICE_NAME)
            ours = verdict(found, settings.service_namespace, settings.service_name)
            have = ((found or {}).get("spec") or {}).get("caBundle")
            if ours.state == "ours" and have != want:
                await set_ca(em.APISERVICE_NAME, want)
                log.info("APIService %s: caBundle set", em.APISERVICE_NAME)
        except Exception as exc:  # the API server away for a while: try again later
            log.warning("APIService %s caBundle not checked: %s", em.APISERVICE_NAME, exc)
        await asyncio.sleep(every_s)


class Servers:
    """The running servers; `stop()` closes them."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.external: str = "off"  # off | serving | refused | failed
        self.task: asyncio.Task[None] | None = None  # the external API's start, if any
        self.ca_task: asyncio.Task[None] | None = None  # keep_ca_bundle, if it runs

    async def _start(self, app: web.Application, address: str, port: int, **kw: Any) -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, address, port, **kw).start()
        self.runners.append(runner)

    async def start_json(self, source: SignalSource, address: str, port: int) -> None:
        """Serves the JSON; a failure (a port in use) is logged, the operator runs on."""
        try:
            await self._start(json_app(source), address, port)
        except OSError as exc:
            log.error("autoscale JSON not served address=%s port=%s: %s", address, port, exc)
            return
        log.info("autoscale JSON served address=%s port=%s", address, port)

    async def start_external(
        self,
        source: SignalSource,
        settings: ExternalSettings,
        get: Getter,
        set_ca: CaSetter | None = None,
    ) -> None:
        """Serves external.metrics.k8s.io unless another provider holds the APIService,
        and keeps its caBundle (with `settings.ca_file` and `set_ca`). A failure is logged
        and leaves the operator running without the API."""
        try:
            found = await get(APISERVICES + em.APISERVICE_NAME)
        except Exception as exc:  # a permission missing, say: serve, and say why unchecked
            log.warning("cannot read APIService %s: %s", em.APISERVICE_NAME, exc)
        else:
            v = verdict(found, settings.service_namespace, settings.service_name)
            if not v.serve:
                self.external = "refused"
                log.error("external metrics not served: %s", v.message)
                return
            log.info("external metrics: %s", v.message)
        if settings.ca_file is not None and set_ca is not None:
            self.ca_task = asyncio.create_task(keep_ca_bundle(settings, get, set_ca))
        try:
            data = await get(AUTH_CONFIGMAP)
            front_proxy = FrontProxy.from_configmap((data or {}).get("data") or {})
            ctx = server_context(settings.cert_file, settings.key_file, front_proxy)
            await self._start(
                external_app(source, front_proxy), settings.address, settings.port, ssl_context=ctx
            )
        except Exception as exc:  # TlsError, a port in use, the ConfigMap unreadable
            self.external = "failed"
            log.error("external metrics not served: %s", exc)
            return
        self.external = "serving"
        log.info(
            "external metrics served address=%s port=%s allowed_clients=%s",
            settings.address,
            settings.port,
            sorted(front_proxy.allowed_names) or "any the front-proxy CA signed",
        )

    async def stop(self) -> None:
        for task in (self.task, self.ca_task):
            if task is not None and not task.done():
                task.cancel()
        for runner in reversed(self.runners):
            await runner.cleanup()
        self.runners.clear()
