"""The request path: which replica serves a request, and what happens when it cannot.

- **Continuation** (the session is bound, or a replica says it holds it): to that replica,
  never gated. If the replica is gone (pod deleted or replaced, engine restarted, connection
  refused, draining, or it no longer holds the session and refuses it as new), the session
  is **re-homed**: sent to the best other replica with ``x-polykv-rehomed: 1`` (the engine
  admits it without the gate and counts it), rebound, and counted here.
- **New session** (nobody holds it) and **one-shot** (no session id): placed by the picker
  over each replica's capacity for the pool and the reservations in flight; a refusal moves
  to the next candidate; when all refuse, one 429 with the smallest Retry-After.
- **Other routes** (``/props``, ``/tokenize``, ...): the least loaded serving replica.

Nothing of this happens before an engine has accepted the client's key (``keycheck``): a
request it refuses is answered 401 by the router itself, having cost at most one engine
call per distinct key and verdict TTL.

A miss in the binding table is not a new session yet: every replica is asked
(``GET /polykv/sessions/{id}``) first, so a restarted router, or a second one, finds it.
The question carries the client's own credentials and nothing of the router's, so an engine
answers only with that client's tenant's session: sessions, bindings and lookups are per
tenant here as in the engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from polykv_api import models as wire
from polykv_api.agent_headers import HeaderError, agent_identity
from polykv_api.tracing import session_hash

from .bindings import Binding, Bindings, SessionKey
from .capacity import CapacityPoller
from .config import Config
from .engines import EngineError, Engines
from .errors import Refusal, error_body, fleet_refusal
from .fleet import Fleet, Replica
from .keycheck import KeyCheck, NoReplica
from .metrics import Metrics
from .names import PUBLIC_PATHS, REHOMED_HEADER
from .picker import rank
from .proxy import Outcome, Proxy, Refused, Relayed
from .request import RequestError, RoutingKey, routing_key
from .reservations import Reservations
from .verdicts import credentials, fingerprint

log = logging.getLogger("polykv.router")
TRACER = trace.get_tracer("polykv.router")  # spans only when polykv_api.tracing set it up

Attempts = tuple[Relayed | None, list[Refusal], int]


class Router:
    def __init__(
        self,
        cfg: Config,
        fleet: Fleet,
        bindings: Bindings,
        reservations: Reservations,
        poller: CapacityPoller,
        engines: Engines,
        proxy: Proxy,
        metrics: Metrics,
        keys: KeyCheck,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.bindings = bindings
        self.reservations = reservations
        self.poller = poller
        self.engines = engines
        self.proxy = proxy
        self.metrics = metrics
        self.keys = keys
        self.clock = clock
        self._lookups: dict[SessionKey, asyncio.Task[Binding | None]] = {}

    # ------------------------------------------------------------------ entry points

    async def inference(self, request: web.Request) -> web.StreamResponse:
        parent = propagate.extract(request.headers)  # the client's traceparent, if any
        with TRACER.start_as_current_span("polykv.route", context=parent, kind=SpanKind.SERVER):
            return await self._inference(request)

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        refused = await self._unauthenticated(request)
        if refused is not None:
            return refused
        body = await request.read()
        try:
            who = agent_identity(request.headers, self.cfg.session_headers)
        except HeaderError as exc:
            raise RequestError(400, "invalid_request", str(exc)) from None
        key = routing_key(who.session, body, who.parent)
        if key.session is None:
            return await self._place(request, body, key, None, t0, "oneshot")
        creds = credentials(request.headers)
        session = (fingerprint(creds), key.session)
        trace.get_current_span().set_attribute("polykv.session.hash", session_hash(*session))
        binding = self.bindings.get(session, self.clock())
        if binding is None:
            binding = await self._lookup(session, creds, key.pool)
        if binding is None:
            near = await self._parent_replica(session[0], key.parent, creds, key.pool)
            resp = await self._place(request, body, key, session, t0, "new", near)
        else:
            resp = await self._continue(request, body, key, session, creds, binding, t0)
        if who.final:  # the engine released the session after this turn: so does the router
            self.bindings.drop(session)
        return resp

    async def _parent_replica(
        self, fp: str, parent: str | None, creds: dict[str, str], pool: str | None
    ) -> str | None:
        """Where a sub-agent's parent session lives (its prefix is resident there)."""
        if parent is None:
            return None
        key = (fp, parent)
        binding = self.bindings.get(key, self.clock()) or await self._lookup(key, creds, pool)
        return binding.replica if binding is not None else None

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        if request.path not in PUBLIC_PATHS:
            refused = await self._unauthenticated(request)
            if refused is not None:
                return refused
        body = await request.read()
        order = self._rank(None, gated=False)
        self._observe("other", t0)
        relayed, refusals, _ = await self._attempts(request, body, order, None, None)
        if relayed is not None:
            return relayed.response
        return self._refused(None, refusals, placement=False)

    async def _unauthenticated(self, request: web.Request) -> web.Response | None:
        """The router's 401 (the engine's shape and words) for a key the engines refuse, a
        503 when no engine could say; None when the request may go on."""
        try:
            if await self.keys.accepted(request.headers):
                return None
        except NoReplica:
            return self._refused(None, [], placement=False)
        body = error_body(401, "unauthorized", "Invalid API Key")
        return web.json_response(body, status=401)

    # ------------------------------------------------------------------ new sessions

    async def _place(
        self,
        request: web.Request,
        body: bytes,
        key: RoutingKey,
        session: SessionKey | None,
        t0: float,
        kind: str,
        near: str | None = None,
    ) -> web.StreamResponse:
        """``near``: the replica to try first (a sub-agent's parent's), if it is a
        candidate at all."""
        if key.pool is not None:
            await self.poller.warm(key.pool, self.cfg.lookup_timeout_s)
        order = self._rank(key.pool, gated=True)
        if near in order:
            order.remove(near)
            order.insert(0, near)
        self._observe(kind, t0)
        relayed, refusals, tried = await self._attempts(
            request, body, order, session, key.pool, bind=True
        )
        if relayed is not None:
            ok = 200 <= relayed.status < 300
            result = ("placed" if tried == 1 else "retried") if ok else "error"
            self.metrics.placements.labels(result).inc()
            if ok and key.session is not None:
                log.info(
                    "session placed",
                    extra={"fields": {"session": key.session, "pool": key.pool,
                                      "replica": relayed.replica,
                                      "attempts": tried}},
                )  # fmt: skip
            return relayed.response
        return self._refused(key.pool, refusals, placement=True)

    # ------------------------------------------------------------------ continuations

    async def _continue(
        self,
        request: web.Request,
        body: bytes,
        key: RoutingKey,
        session: SessionKey,
        creds: dict[str, str],
        b: Binding,
        t0: float,
    ) -> web.StreamResponse:
        pool = key.pool if key.pool is not None else b.pool
        r = self.fleet.get(b.replica)
        why: str | None = None
        if r is None or r.pod.uid != b.uid:
            why = "pod_gone"
        elif b.boot_id is None:
            b.boot_id = r.boot_id  # placed before the first poll of this replica: learn it now
        elif r.boot_id is not None and r.boot_id != b.boot_id:
            why = await self._restarted(r, session[1], creds, b)
        if why is None and r is not None:
            self._observe("continuation", t0)
            outcome = await self._send(request, body, r, session, pool, bind=False)
            if isinstance(outcome, Relayed):
                self.bindings.touch(session, self.clock())
                return outcome.response
            if isinstance(outcome, Refused):
                # A 503: it is draining or lost its KV. A 429: it no longer holds the session
                # (a continuation is never gated), so to it this was a new session.
                why = "draining" if outcome.refusal.status == 503 else "lost"
            else:
                why = "unreachable"
            return await self._rehome(request, body, session, creds, pool, b.replica, why, None)
        assert why is not None
        return await self._rehome(request, body, session, creds, pool, b.replica, why, t0)

    async def _restarted(
        self, r: Replica, session: str, creds: dict[str, str], b: Binding
    ) -> str | None:
        """The replica's engine restarted since the session was bound. If the new process
        holds the session anyway (a turn reached it since), keep it; else it is gone."""
        try:
            info = await self.engines.session(r.pod, session, creds)
        except EngineError:
            return "restarted"
        if info is not None and info.boot_id == r.boot_id:
            b.boot_id = info.boot_id
            return None
        return "restarted"

    async def _rehome(
        self,
        request: web.Request,
        body: bytes,
        session: SessionKey,
        creds: dict[str, str],
        pool: str | None,
        old: str,
        why: str,
        t0: float | None,
    ) -> web.StreamResponse:
        """``t0`` is None when the time before the first try has been counted already."""
        if pool is not None:
            await self.poller.warm(pool, self.cfg.lookup_timeout_s)
        order = self._rank(pool, gated=False, avoid=old)
        # A replica may hold the session's cache already: saved by the old process at its
        # shutdown, in a snapshot directory the replica reads (a claim the new pod mounts).
        holder = await self._lookup(session, creds, pool)
        if holder is not None and holder.replica in order:
            order.remove(holder.replica)
            order.insert(0, holder.replica)
        if t0 is not None:
            self._observe("rehome", t0)
        relayed, refusals, _ = await self._attempts(
            request, body, order, session, pool, extra={REHOMED_HEADER: "1"}, bind=True
        )
        if relayed is None:
            log.warning(
                "session could not be re-homed",
                extra={"fields": {"session": session[1], "from": old, "reason": why}},
            )
            return self._refused(pool, refusals, placement=False)
        self.metrics.rehomes.labels(why).inc()
        log.info(
            "session re-homed",
            extra={"fields": {"session": session[1], "pool": pool, "from": old, "reason": why,
                              "to": relayed.replica}},
        )  # fmt: skip
        return relayed.response

    # ------------------------------------------------------------------ lookups

    async def _lookup(
        self, session: SessionKey, creds: dict[str, str], pool: str | None
    ) -> Binding | None:
        """Asks every replica whether it holds the session, with the client's credentials
        (one question per session at a time, however many requests wait for the answer)."""
        task = self._lookups.get(session)
        if task is None:
            task = asyncio.create_task(self._ask_all(session, creds, pool))
            self._lookups[session] = task
            task.add_done_callback(lambda _: self._lookups.pop(session, None))
        return await asyncio.shield(task)

    async def _ask_all(
        self, session: SessionKey, creds: dict[str, str], pool: str | None
    ) -> Binding | None:
        replicas = list(self.fleet)
        answers = await asyncio.gather(*(self._ask(r, session[1], creds) for r in replicas))
        found = [(r, info) for r, info in zip(replicas, answers, strict=True) if info is not None]
        if not found:
            self.metrics.lookups.labels("not_found").inc()
            return None
        # Two holders (a copy left behind by a re-home): the serving one, then the longer
        # context, which has the later turns.
        r, info = max(found, key=lambda f: (f[0].pod.serving, f[1].ctx_used))
        b = Binding(r.name, r.pod.uid, info.boot_id, pool or info.pool_name, self.clock())
        self.bindings.bind(session, b)
        self.metrics.lookups.labels("found").inc()
        log.info(
            "session found on a replica",
            extra={"fields": {"session": session[1], "replica": r.name, "holders": len(found)}},
        )
        return b

    async def _ask(
        self, r: Replica, session: str, creds: dict[str, str]
    ) -> wire.SessionInfo | None:
        try:
            return await self.engines.session(r.pod, session, creds)
        except EngineError as exc:
            log.debug("session lookup failed: %s", exc)
            return None

    # ------------------------------------------------------------------ sending

    def _rank(self, pool: str | None, gated: bool, avoid: str | None = None) -> list[str]:
        now = self.clock()
        views = self.fleet.views(
            pool, self.bindings.per_replica(), now, self.cfg.capacity_max_age_s
        )
        reserved = self.reservations.counts(pool, now) if pool is not None else {}
        return rank(views, reserved, gated=gated, avoid=avoid)

    async def _attempts(
        self,
        request: web.Request,
        body: bytes,
        order: list[str],
        session: SessionKey | None,
        pool: str | None,
        extra: dict[str, str] | None = None,
        bind: bool = False,
    ) -> Attempts:
        """Tries the candidates in order (at most max_attempts): the first that does not
        refuse answers the client. Returns (that answer or None, the refusals, tries)."""
        refusals: list[Refusal] = []
        tried = 0
        for name in order[: self.cfg.max_attempts]:
            r = self.fleet.get(name)
            if r is None:
                continue
            tried += 1
            outcome = await self._send(request, body, r, session, pool, extra, bind)
            if isinstance(outcome, Relayed):
                return outcome, refusals, tried
            if isinstance(outcome, Refused):
                refusals.append(outcome.refusal)
                self.metrics.engine_refusals.labels(outcome.refusal.reason).inc()
            else:
                refusals.append(Refusal(name, 503, "unreachable", None))
                log.warning(
                    "replica unreachable: %s", outcome.error, extra={"fields": {"pod": name}}
                )
        return None, refusals, tried

    async def _send(
        self,
        request: web.Request,
        body: bytes,
        r: Replica,
        session: SessionKey | None,
        pool: str | None,
        extra: dict[str, str] | None = None,
        bind: bool = False,
    ) -> Outcome:
        """One try on one replica, with its reservation, in-flight count and binding."""
        # A placement or a re-home adds a session to the replica: reserve it. A continuation
        # is already in the replica's figures.
        reserve = bind and pool is not None
        res = self.reservations.add(r.name, pool, self.clock()) if reserve and pool else None
        boot, uid = r.boot_id, r.pod.uid

        def accept(status: int) -> None:
            now = self.clock()
            ok = 200 <= status < 300
            if res is not None:
                if ok:
                    self.reservations.accepted(res, now)
                else:
                    self.reservations.release(res)
            if ok and bind and session is not None:
                self.bindings.bind(session, Binding(r.name, uid, boot, pool, now))

        r.in_flight += 1
        attrs = {"polykv.replica": r.name, "polykv.pool.ref": pool or ""}
        with TRACER.start_as_current_span("polykv.forward", kind=SpanKind.CLIENT, attributes=attrs):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)  # the engine's span continues this one
            try:
                outcome = await self.proxy.forward(
                    request, body, r.pod, {**(extra or {}), **carrier}, accept
                )
            finally:
                r.in_flight -= 1
                if res is not None and res.accepted_at is None:
                    self.reservations.release(res)
            if isinstance(outcome, Refused):
                trace.get_current_span().set_attribute("error.type", outcome.refusal.reason)
        return outcome

    # ------------------------------------------------------------------ answers

    def _refused(self, pool: str | None, refusals: list[Refusal], placement: bool) -> web.Response:
        if not refusals:
            if placement:
                self.metrics.placements.labels("unavailable").inc()
            body = error_body(503, "no_replica", "no engine replica is serving")
            return web.json_response(body, status=503, headers={"Retry-After": "1"})
        status, body, retry = fleet_refusal(pool, refusals)
        if placement:
            self.metrics.placements.labels("rejected" if status == 429 else "unavailable").inc()
        if status == 429:
            reason = str(body["error"]["reason"])
            self.metrics.fleet_rejects.labels(reason).inc()
            log.info(
                "every replica refused a new session",
                extra={"fields": {"pool": pool, "reason": reason, "retry_after": retry,
                                  "tried": [f.replica for f in refusals]}},
            )  # fmt: skip
        return web.json_response(body, status=status, headers={"Retry-After": str(retry)})

    def _observe(self, kind: str, t0: float) -> None:
        self.metrics.added_latency.labels(kind).observe(time.perf_counter() - t0)
        trace.get_current_span().set_attribute("polykv.routing.kind", kind)
