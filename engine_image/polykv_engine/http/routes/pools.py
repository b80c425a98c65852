"""``/polykv/pools`` routes: create, fork, pin/unpin/evict/flush, release, status.

Mutating routes need the admin key (``--polykv-admin-key``, else ``--api-key``). Every route
that takes a pool id also takes the pool's name: ids are per replica, names are not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash
from aiohttp import web

from polykv_api.models import (
    AdmissionPolicy,
    CapacityReport,
    CapacitySummary,
    PoolCreated,
    PoolCreateRequest,
    PoolDetail,
    PoolForkRequest,
    PoolList,
    PoolPrefix,
    PoolRef,
    PoolReleased,
    PoolRestore,
    PoolStatus,
)
from polykv_engine.core import pool_ops
from polykv_engine.core.engine import Engine
from polykv_engine.http import snapshot_peer, tracing
from polykv_engine.http.app_context import AppContext, ctx_of
from polykv_engine.http.auth import identity_of, require_admin
from polykv_engine.http.errors import ApiError, body_bytes, parse
from polykv_engine.http.offload import offload
from polykv_engine.ids import decimal
from polykv_engine.persist.fileformat import KVSnapshot, SnapshotRefused
from polykv_engine.pools.manager import PoolSpec
from polykv_engine.pools.tree import Pool, PoolError, Source, validate_name

T = TypeVar("T")


def _api_error(exc: PoolError) -> ApiError:
    return ApiError(exc.status, exc.message, exc.type, reason=exc.reason)


async def on_engine(ctx: AppContext, fn: Callable[[Engine], T]) -> T:
    """Run ``fn`` on the engine thread; a PoolError becomes the matching HTTP error."""
    ctx.require_ready()
    with ctx.owed():  # a pool's prefill is work the SIGTERM drain must wait for
        try:
            return await asyncio.wrap_future(ctx.engine.call(fn))
        except PoolError as exc:
            raise _api_error(exc) from exc


async def pool_listing(ctx: AppContext, sees: pool_ops.Viewer | None = None) -> PoolList:
    """Every pool with its capacity, and the engine-wide autoscaling signals; ``sees``:
    other tenants' sessions without their ids."""
    listing = await on_engine(ctx, lambda e: pool_ops.listing(e, ctx.boot_id, sees))
    _add_capacity(ctx, listing.pools)
    assert ctx.gate is not None
    pressure, active, refused, headroom = ctx.gate.autoscale()
    listing.floor_pressure = pressure
    listing.sessions_active = active
    listing.sessions_refused = refused
    listing.sessions_headroom = headroom
    return listing


async def subtree(
    ctx: AppContext, ref: PoolRef, sees: pool_ops.Viewer | None = None
) -> list[PoolStatus]:
    """``ref``'s status first, then its descendants', each with its capacity: built for
    those pools alone, so the answer costs the same with 10 or 250 other pools."""
    statuses = await on_engine(ctx, lambda e: pool_ops.subtree(e, ref, sees))
    _add_capacity(ctx, statuses)
    return statuses


def _add_capacity(ctx: AppContext, statuses: list[PoolStatus]) -> None:
    snap = ctx.engine.snapshot
    assert ctx.gate is not None
    for status in statuses:
        pool = snap.pool(status.pool_id)
        if pool is None:
            continue
        cap = ctx.gate.capacity(pool, None, None)
        status.capacity = CapacitySummary(
            can_admit=cap.can_admit,
            reason=cap.reason,
            reason_code=cap.reason_code,
            headroom_sessions=cap.headroom_sessions,
            settling=cap.settling,
            compaction_pressure=cap.compaction_pressure,
        )


def _ref(request: web.Request) -> PoolRef:
    raw = request.match_info["pool"]
    number = decimal(raw)
    return number if number is not None else raw


def _prefix_tokens(ctx: AppContext, req: PoolPrefix) -> list[int] | None:
    rt = ctx.rt
    if req.tokens is not None:
        tokens = ctx.check_token_ids(req.tokens)
    elif req.prompt is not None:
        tokens = rt.tokenize(req.prompt, add_special=True, parse_special=True)
    elif req.messages is not None:
        text = ctx.render_messages(req.messages, req.tools, add_generation_prompt=False)
        tokens = rt.tokenize(text, add_special=True, parse_special=True)
    else:
        return None  # from_session: the engine reads the session's tokens
    return ctx.check_prompt_fits(tokens, for_pool=True)


@dataclass(frozen=True, slots=True)
class _Found:
    """What the snapshot lookup for a new pool found."""

    snapshot: KVSnapshot | None = None
    source: Source = "store"
    refused: SnapshotRefused | None = None


async def _find_snapshot(ctx: AppContext, req: PoolPrefix, tokens: list[int] | None) -> _Found:
    """This replica's stored snapshot of the prefix, else the peer's the request names
    (read and checked off the event loop); nothing for a pool that exists already."""
    store = ctx.engine.snapshots
    if store is None or tokens is None or req.dry_run:
        return _Found()
    if req.name is not None and ctx.engine.snapshot.pool(req.name) is not None:
        return _Found()  # a retried create: the engine returns the pool it has
    key = store.pool_key(tokens)
    n_swa = ctx.rt.info.n_swa
    bound = store.bound(len(tokens), n_spans=len(tokens) // n_swa + 2 if n_swa else 1)
    try:
        snap = await asyncio.to_thread(store.load, key, bound)
        if snap is not None:
            return _Found(snap, "store")
        if req.restore_peer is None:
            return _Found()
        admin = ctx.settings.admin_keys[0] if ctx.settings.admin_keys else None
        what = f"pool {req.name or key.subject[:12]}"
        snap = await snapshot_peer.fetch(store, req.restore_peer, key, bound, admin, what)
        return _Found(snap, "peer")
    except SnapshotRefused as exc:
        return _Found(refused=exc)


async def _create(request: web.Request, req: PoolPrefix, parent: PoolRef | None) -> web.Response:
    attrs: dict[str, str | bool] = {
        "polykv.pool.name": req.name or "",
        "polykv.pool.dry_run": req.dry_run,
    }
    if parent is not None:
        attrs["polykv.pool.parent"] = str(parent)
    with tracing.server_span(request.headers, "polykv.pool.create", attrs) as span:
        resp = await _create_traced(request, req, parent)
        span.set_attribute("http.response.status_code", resp.status)
        return resp


async def _create_traced(
    request: web.Request, req: PoolPrefix, parent: PoolRef | None
) -> web.Response:
    ctx = ctx_of(request)
    if req.name is not None:
        try:
            validate_name(req.name)
        except PoolError as exc:
            raise _api_error(exc) from exc
    # A 30k-token prefix's template and tokenizing take tens of ms, seconds for a large body:
    # off the event loop, like an inference request's prompt.
    tokens = await offload(request, body_bytes(request), _prefix_tokens, ctx, req)
    t0 = time.perf_counter()
    found = await _find_snapshot(ctx, req, tokens)
    spec = PoolSpec(
        tokens=tokens,
        from_session=req.from_session,
        name=req.name,
        pin=req.pin,
        dry_run=req.dry_run,
        parent=parent,
        branch_pos=getattr(req, "branch_pos", None),
        snapshot=found.snapshot,
        snapshot_source=found.source,
    )
    result = await on_engine(ctx, lambda e: pool_ops.create(e, spec))
    if isinstance(result, Pool):  # dry run: what would be created
        body = PoolCreated(
            created=False,
            dry_run=True,
            prefix_len=result.prefix_len,
            branch_pos=result.branch_pos,
            prefix_hash=result.prefix_hash,
            boot_id=ctx.boot_id,
        )
        return web.json_response(body.model_dump())
    try:
        await asyncio.wrap_future(result.ready)
    except PoolError as exc:
        raise _api_error(exc) from exc
    pool_id = result.pool.pool_id
    status = (await subtree(ctx, pool_id))[0]
    restore = None
    if result.created:
        refused = result.refused or found.refused
        source = result.pool.source
        seconds = time.perf_counter() - t0
        restored = found.snapshot if source in ("store", "peer") else None
        if restored is not None and ctx.restore_seconds is not None:
            ctx.restore_seconds.labels(source).observe(seconds)
        restore = PoolRestore(
            source=source,
            refused=refused.reason if refused else None,
            message=refused.message if refused else None,
            snapshot_bytes=found.snapshot.size
            if source in ("store", "peer") and found.snapshot
            else 0,
            seconds=seconds,
        )
    body = PoolCreated(
        created=result.created,
        restore=restore,
        pool=status,
        pool_id=status.pool_id,
        prefix_len=status.prefix_len,
        branch_pos=status.branch_pos,
        prefix_hash=status.prefix_hash,
        boot_id=ctx.boot_id,
    )
    return web.json_response(body.model_dump(), status=201 if result.created else 200)


async def create_pool(request: web.Request) -> web.Response:
    require_admin(request)
    req = await parse(request, PoolCreateRequest)
    return await _create(request, req, None)


async def fork_pool(request: web.Request) -> web.Response:
    require_admin(request)
    req = await parse(request, PoolForkRequest)
    return await _create(request, req, _ref(request))


def _action(name: pool_ops.Action) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.Response:
        require_admin(request)
        ctx = ctx_of(request)
        ref = _ref(request)
        await on_engine(ctx, lambda e: pool_ops.act(e, ref, name))
        return web.json_response((await subtree(ctx, ref))[0].model_dump())

    handler.__name__ = f"{name}_pool"
    return handler


async def release_pool(request: web.Request) -> web.Response:
    require_admin(request)
    ctx = ctx_of(request)
    ref = _ref(request)
    pool_id = await on_engine(ctx, lambda e: pool_ops.release(e, ref))
    return web.json_response(PoolReleased(released=pool_id, boot_id=ctx.boot_id).model_dump())


async def list_pools(request: web.Request) -> web.Response:
    """The listing with a strong ETag over its bytes: a poller that sends it back as
    If-None-Match gets 304 and no body while nothing in the listing changed (an idle
    operator then parses nothing, however many pools there are)."""
    ctx = ctx_of(request)
    listing = await pool_listing(ctx, identity_of(request).sees)
    body = listing.model_dump_json().encode()
    etag = xxhash.xxh3_64_hexdigest(body)
    headers = {"ETag": f'"{etag}"'}
    for tag in request.if_none_match or ():
        if tag.value in (etag, "*"):  # weak or strong: a 304 is the same answer for a GET
            return web.Response(status=304, headers=headers)
    return web.Response(body=body, content_type="application/json", headers=headers)


async def get_pool(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    ref = _ref(request)
    pool, *descendants = await subtree(ctx, ref, identity_of(request).sees)
    body = PoolDetail(**pool.model_dump(), descendants=descendants, boot_id=ctx.boot_id)
    return web.json_response(body.model_dump())


async def _apply_admission(request: web.Request, policy: AdmissionPolicy | None) -> web.Response:
    ctx = ctx_of(request)
    ref = _ref(request)
    await on_engine(ctx, lambda e: pool_ops.set_admission(e, ref, policy))
    return web.json_response((await subtree(ctx, ref))[0].model_dump())


async def set_admission(request: web.Request) -> web.Response:
    require_admin(request)
    return await _apply_admission(request, await parse(request, AdmissionPolicy))


async def clear_admission(request: web.Request) -> web.Response:
    require_admin(request)
    return await _apply_admission(request, None)


def _int_query(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    value = decimal(raw)
    if value is None or value < 1:
        raise ApiError(400, f"{name}: a positive integer, got {raw!r}")
    return value


async def get_capacity(request: web.Request) -> web.Response:
    """Answered from the published snapshot: never waits for the engine thread."""
    ctx = ctx_of(request)
    ctx.require_ready()
    ref = _ref(request)
    expected = _int_query(request, "expected_tokens")
    session = request.query.get("session_id") or request.headers.get("x-session-id")
    pool = ctx.engine.snapshot.pool(ref)
    who = identity_of(request)
    if pool is None or (pool.owner is not None and not who.sees(pool.owner)):
        raise ApiError(
            404, f"pool {ref!r} does not exist", "not_found_error", reason="pool_not_found"
        )
    assert ctx.gate is not None
    cap = ctx.gate.capacity(pool, expected, session, None if who.admin else who.tenant)
    body = CapacityReport(
        pool_id=pool.pool_id,
        policy=pool.admission,
        **cap.model_dump(),
    )
    return web.json_response(body.model_dump())


async def slot_action(request: web.Request) -> web.Response:
    """llama-server's ``POST /slots/{id}?action=erase``; save/restore are not supported."""
    require_admin(request)
    ctx = ctx_of(request)
    raw = request.match_info["slot"]
    if decimal(raw) is None:
        raise ApiError(400, f"slot id must be an integer, got {raw!r}")
    action = request.query.get("action")
    if action != "erase":
        raise ApiError(
            501 if action in ("save", "restore") else 400,
            f"unsupported slot action {action!r}; supported: erase",
        )
    slot_id = int(raw)
    n = await on_engine(ctx, lambda e: pool_ops.erase_slot(e, slot_id))
    return web.json_response({"id_slot": slot_id, "n_erased": n})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/slots/{slot}", slot_action)
    app.router.add_post("/polykv/pools", create_pool)
    app.router.add_get("/polykv/pools", list_pools)
    app.router.add_get("/polykv/pools/{pool}", get_pool)
    app.router.add_delete("/polykv/pools/{pool}", release_pool)
    app.router.add_post("/polykv/pools/{pool}/fork", fork_pool)
    app.router.add_post("/polykv/pools/{pool}/admission", set_admission)
    app.router.add_delete("/polykv/pools/{pool}/admission", clear_admission)
    app.router.add_get("/polykv/pools/{pool}/capacity", get_capacity)
    for action in ("pin", "unpin", "evict", "flush"):
        app.router.add_post(f"/polykv/pools/{{pool}}/{action}", _action(action))
