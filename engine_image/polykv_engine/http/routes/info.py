"""Read-only routes: /health, /props, /slots, /v1/models, /polykv/tps, /metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from polykv_api.models import (
    CpuBackend,
    KvMemory,
    PolykvProps,
    SessionInfo,
    SessionTps,
    TpsSnapshot,
)
from polykv_engine import __version__
from polykv_engine.core import pool_ops
from polykv_engine.core.snapshot import EngineSnapshot
from polykv_engine.http import session_restore
from polykv_engine.http.app_context import AppContext, ctx_of
from polykv_engine.http.auth import identity_of
from polykv_engine.http.errors import ApiError
from polykv_engine.http.metrics import PoolGauges
from polykv_engine.ids import decimal

METRICS_REGISTRY = web.AppKey("metrics_registry", object)


async def health(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    if ctx.engine.load_error is not None:
        raise ApiError(500, f"model failed to load: {ctx.engine.load_error}", "server_error")
    if ctx.draining:
        raise ApiError(
            503, "server is shutting down", headers={"Retry-After": "5"}, reason="shutting_down"
        )
    if not ctx.engine.ready:
        raise ApiError(503, "Loading model", headers={"Retry-After": "1"}, reason="loading")
    return web.json_response({"status": "ok"})


def kv_memory(ctx: AppContext) -> KvMemory:
    rt = ctx.rt
    info = rt.info
    memory = ctx.engine.memory
    swa_full = rt.cfg.swa_full and info.n_swa > 0
    extra = ctx.engine.swa_full_cost if swa_full else 0
    return KvMemory(
        kind=memory.kind,
        sliding_window=info.n_swa,
        swa_full=swa_full,
        swa_full_extra_bytes=extra,
        recurrent_state_bytes=rt.state_bytes,
        pools=ctx.engine.pools_disabled_reason or memory.pools_summary(),
    )


def polykv_props(ctx: AppContext) -> PolykvProps:
    rt = ctx.rt
    cfg = ctx.engine.cfg
    return PolykvProps(
        boot_id=ctx.boot_id,
        version=__version__,
        n_parallel=cfg.n_parallel,
        max_pools=cfg.max_pools,
        seq_ids_max=cfg.n_parallel + cfg.max_pools,  # usable: internal spares are not
        kv_unified=cfg.runtime.kv_unified,
        n_ctx=rt.n_ctx,
        n_ctx_slot=ctx.engine.snapshot.n_ctx_slot,
        kv_bytes_per_token=rt.kv_bytes_per_token,
        tps_window_tokens=cfg.tps_window_tokens,
        tps_window_seconds=cfg.tps_window_s,
        tps_stream_interval_ms=ctx.settings.tps_stream_interval_ms,
        context_shift=cfg.context_shift,
        cpu_backend=CpuBackend(
            variant=rt.backend.cpu_variant,
            features=rt.backend.features,
            extra_buffer_types=list(rt.backend.extra_buffer_types),
            repack=rt.repack,
            amx=rt.backend.amx,
            patches=list(rt.backend.patches),
            kernel_paths=list(rt.backend.kernel_paths),
            threads=rt.n_threads,
            threads_batch=rt.n_threads_batch,
            omp_wait=rt.omp_wait,
            cpu_limit=rt.cpu_limit,
        ),
        memory=kv_memory(ctx),
    )


async def props(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    rt = ctx.rt
    info = rt.info
    n_ctx_slot = ctx.engine.snapshot.n_ctx_slot
    body: dict[str, Any] = {
        "default_generation_settings": {
            "n_ctx": n_ctx_slot,
            "params": {
                "temperature": 0.8,
                "top_k": 40,
                "top_p": 0.95,
                "min_p": 0.05,
                "n_predict": -1,
            },
        },
        "total_slots": ctx.engine.cfg.n_parallel,
        "model_alias": ctx.model_name,
        "model_path": info.path,
        "modalities": {"vision": False, "audio": False},
        "chat_template": ctx.renderer.source,
        "bos_token": rt.token_bytes(info.bos, special=True).decode("utf-8", "replace"),
        "eos_token": rt.token_bytes(info.eos, special=True).decode("utf-8", "replace"),
        "build_info": f"polykv-{__version__}",
        "polykv": polykv_props(ctx).model_dump(),
    }
    return web.json_response(body)


async def slots(request: web.Request) -> web.Response:
    """llama-server's /slots (the running or last request's figures and settings; no
    prompt text), plus PolyKV's session, pool and tps fields. A slot serving another tenant
    shows its load (state, rate, context used) but no session id, settings (grammar, stop
    strings) or prompt figures."""
    ctx = ctx_of(request)
    who = identity_of(request)
    ctx.require_ready()
    snap = ctx.engine.snapshot
    if request.query.get("fail_on_no_slot") in ("1", "true") and all(
        s.processing for s in snap.slots
    ):
        raise ApiError(503, "no slot available", reason="queue_full", headers={"Retry-After": "1"})
    out = []
    for s in snap.slots:
        task = s.task_id if s.task_id is not None else s.last_task_id
        mine = who.sees(s.tenant)
        out.append(
            {
                "id": s.slot_id,
                "id_task": task,
                "n_ctx": s.n_ctx,
                "speculative": s.speculative,
                "is_processing": s.processing,
                "n_prompt_tokens": s.n_prompt if mine else 0,
                "n_prompt_tokens_processed": s.n_prompt - s.n_cached if mine else 0,
                "n_prompt_tokens_cache": s.n_cached if mine else 0,
                "params": s.params if mine else {},
                "next_token": [
                    {
                        "has_next_token": s.processing,
                        "has_new_line": False,
                        "n_remain": s.n_remain,
                        "n_decoded": s.n_decoded,
                    }
                ],
                "state": s.state,
                "session_id": s.session_id if mine else None,
                "pool_id": s.pool_id,
                "tps_ewma": s.tps_ewma,
                "warming": s.warming and s.processing,
                "ctx_used": s.ctx_used,
                "ctx_headroom_tokens": s.n_ctx - s.ctx_used,
                "ttft_ms": s.ttft_ms,
                "draft_n": s.draft_n,
                "draft_n_accepted": s.draft_n_accepted,
            }
        )
    return web.json_response(out)


async def models(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    info = ctx.rt.info
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": ctx.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "polykv",
                    "meta": {
                        "n_vocab": info.n_vocab,
                        "n_ctx_train": info.n_ctx_train,
                        "n_embd": info.n_embd,
                        "n_params": info.n_params,
                        "size": info.size_bytes,
                    },
                }
            ],
        }
    )


def tps_snapshot(snap: EngineSnapshot, sees: Callable[[str | None], bool]) -> TpsSnapshot:
    """Every session's rate; ``sees``: whose session ids the caller may read."""
    sessions = [
        SessionTps(
            session_id=s.session_id if sees(s.tenant) else None,
            slot=s.slot_id,
            pool_id=s.pool_id,
            state=s.state,
            tps_ewma=s.tps_ewma,
            warming=s.warming and s.processing,
            ctx_used=s.ctx_used,
            ctx_total=s.n_ctx,
            ctx_headroom_tokens=s.n_ctx - s.ctx_used,
            draft_n=s.draft_n,
            draft_n_accepted=s.draft_n_accepted,
        )
        for s in snap.slots
        if s.processing or s.session_id is not None
    ]
    active = snap.active
    return TpsSnapshot(
        ts=snap.ts,
        aggregate_tps=snap.aggregate_tps,
        prefill_tps=snap.prefill_tps,
        mean_active_tps=active.mean,
        n_active=active.n_active,
        n_warming=active.n_warming,
        sessions=sessions,
    )


async def polykv_tps(request: web.Request) -> web.StreamResponse:
    """One JSON snapshot, or an SSE stream when the client accepts text/event-stream."""
    ctx = ctx_of(request)
    ctx.require_ready()
    sees = identity_of(request).sees
    if "text/event-stream" not in request.headers.get("Accept", ""):
        return web.json_response(tps_snapshot(ctx.engine.snapshot, sees).model_dump())
    interval_ms = ctx.settings.tps_stream_interval_ms
    raw = request.query.get("interval_ms")
    if raw is not None:
        value = decimal(raw)
        if value is None or not 50 <= value <= 60_000:
            raise ApiError(400, "interval_ms: an integer between 50 and 60000")
        interval_ms = value
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    while not ctx.draining:
        data = json.dumps(tps_snapshot(ctx.engine.snapshot, sees).model_dump())
        await resp.write(f"data: {data}\n\n".encode())
        await asyncio.sleep(interval_ms / 1e3)
    await resp.write_eof()
    return resp


async def _pool_gauges(ctx: AppContext) -> list[PoolGauges]:
    listing = await asyncio.wrap_future(ctx.engine.call(lambda e: pool_ops.listing(e, ctx.boot_id)))
    assert ctx.gate is not None
    snap = ctx.engine.snapshot
    rows = []
    for p in listing.pools:
        if p.kept_until is not None:
            continue  # unnamed and short-lived: counted in polykv_kept_prefixes instead
        decoding = [s.tps_ewma for s in p.sessions if s.state == "decoding"]
        pool = snap.pool(p.pool_id)
        pressure = ctx.gate.capacity(pool, None, None).compaction_pressure if pool else 0.0
        rows.append(
            PoolGauges(
                label=p.name or str(p.pool_id),
                sessions=len(p.sessions),
                own_kv_bytes=p.own_kv_bytes,
                subtree_kv_bytes=p.subtree_kv_bytes,
                gen_throughput_tps=sum(decoding),
                mean_active_tps=p.mean_active_tps,
                compaction_pressure=pressure,
                active_sessions=p.n_active,
                active_tps_sum=p.active_tps_sum,
                floor_tps=p.admission.target_tps_per_session if p.admission else 0.0,
                refused_sessions=ctx.gate.refused_recently(p.name or str(p.pool_id)),
            )
        )
    return rows


async def metrics(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    if not ctx.settings.metrics:
        raise ApiError(501, "metrics are disabled; start the engine with --metrics")
    if ctx.engine.ready:  # refreshed even when empty: released pools' gauges disappear
        ctx.pool_gauges = await _pool_gauges(ctx) if ctx.engine.snapshot.pools else []
    registry: Any = request.app[METRICS_REGISTRY]
    body = generate_latest(registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def session(request: web.Request) -> web.Response:
    """Where a session lives on this replica: 200, or 404 (reason session_not_found)."""
    ctx = ctx_of(request)
    ctx.require_ready()
    sid = request.match_info["session"]
    snap = ctx.engine.snapshot
    who = identity_of(request)
    # A tenant finds its own sessions, the admin any. The router asks with the client's
    # own key, so its key widens nothing here.
    slot = next((s for s in snap.slots if s.session_id == sid and who.sees(s.tenant)), None)
    if slot is None:
        # Saved by the process before this one, restored at its next turn: the caller's
        # own tenant only (a file's name is the tenant's and the id's digest).
        stored = await session_restore.stored_length(ctx, who.tenant, sid)
        if stored is None:
            raise ApiError(
                404,
                f"session {sid!r} is not on this replica",
                "not_found_error",
                reason="session_not_found",
            )
        body = SessionInfo(
            session_id=sid,
            boot_id=ctx.boot_id,
            slot=None,
            state="idle",
            kv="stored",
            pool_id=None,
            pool_name=None,
            ctx_used=stored,
            ctx_headroom_tokens=max(snap.n_ctx_slot - stored, 0),
            tps_ewma=0.0,
        )
        return web.json_response(body.model_dump())
    pool = snap.pool(slot.pool_id) if slot.pool_id is not None else None
    body = SessionInfo(
        session_id=sid,
        boot_id=ctx.boot_id,
        slot=slot.slot_id,
        state=slot.state,
        kv="parked" if slot.n_parked else "slot",
        pool_id=slot.pool_id,
        pool_name=pool.name if pool else None,
        ctx_used=slot.ctx_used,
        ctx_headroom_tokens=slot.n_ctx - slot.ctx_used,
        tps_ewma=slot.tps_ewma,
    )
    return web.json_response(body.model_dump())


def add_routes(app: web.Application) -> None:
    for path in ("/health", "/v1/health"):
        app.router.add_get(path, health)
    app.router.add_get("/props", props)
    app.router.add_get("/slots", slots)
    for path in ("/v1/models", "/models"):
        app.router.add_get(path, models)
    app.router.add_get("/polykv/tps", polykv_tps)
    app.router.add_get("/polykv/sessions/{session}", session)
    app.router.add_get("/metrics", metrics)
