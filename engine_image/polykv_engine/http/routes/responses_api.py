"""OpenAI's Responses API: ``POST /v1/responses``, for function-calling agents (Codex).

The request is translated into the engine's chat form (``chat/openai_responses.py``) and run
like any chat request. Which session it is: the body's ``session_id`` or an agent header
(``polykv_api.agent_headers``: Codex's ``thread-id``), else ``prompt_cache_key`` (unless it
names a pool on this engine: then the request attaches to that pool), else the session of
``previous_response_id``, else a session of its own named after the response. A response's
turns are kept for ``previous_response_id`` while its session is (``response_store.py``).

A ``prompt_cache_key`` that names no pool also asks for the prompt's prefix before its
newest user turn (instructions, tools, the conversation so far) to be kept for five minutes,
as OpenAI caches prompt prefixes: the tenant's later requests, in any session, read it
(``http.kept_prefix``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from aiohttp import web

from polykv_api.models import ChatMessage
from polykv_api.openai_responses import ResponsesRequest
from polykv_engine.chat.openai_responses import chat_form
from polykv_engine.chat.turns import mark_last_user
from polykv_engine.http import kept_prefix
from polykv_engine.http.app_context import AppContext, ctx_of
from polykv_engine.http.auth import identity_of
from polykv_engine.http.errors import ApiError, body_bytes, parse
from polykv_engine.http.offload import offload
from polykv_engine.http.response_store import Stored, size_of
from polykv_engine.http.routes.inference import (
    OutputSchema,
    PreparedChat,
    QueueSink,
    check_repeat_last_n,
    identity_of_agent,
    prepare_chat,
    run,
    task_from,
)
from polykv_engine.http.wire_responses import ResponsesWire


def _output(req: ResponsesRequest) -> OutputSchema | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    return fmt.schema_, "text.format.schema" if fmt.schema_ is not None else "text.format"


def _prepare(
    ctx: AppContext, req: ResponsesRequest, earlier: list[ChatMessage], keeps: bool
) -> tuple[PreparedChat, list[ChatMessage], int]:
    """The chat, the conversation so far, and how many of its tokens come before the
    newest user turn when the prefix is to be kept (else 0)."""
    try:
        form, history = chat_form(req, earlier)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    chat = prepare_chat(
        ctx, form.messages, form.tools, form.tool_choice, form.parallel_tool_calls, _output(req)
    )
    marked = mark_last_user(form.messages) if keeps else None
    if marked is None:
        return chat, history, 0
    n = kept_prefix.prefix_len(ctx, chat.text, chat.prompt, marked, form.tools)
    return chat, history, n


async def responses(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    req = await parse(request, ResponsesRequest)
    check_repeat_last_n(ctx, req)
    tenant = identity_of(request).tenant
    earlier: list[ChatMessage] = []
    earlier_session: str | None = None
    if req.previous_response_id is not None:
        stored = ctx.responses.get(tenant, req.previous_response_id)
        if stored is None:
            raise ApiError(
                404,
                f"previous_response_id {req.previous_response_id!r}: no such response on this "
                "engine (never made here, or released with its session); send the whole "
                "conversation as input instead",
                "not_found_error",
                reason="response_not_found",
            )
        earlier, earlier_session = list(stored.history), stored.session_id
    response_id = f"resp_{uuid.uuid4().hex}"
    identity = identity_of_agent(request, req.session_id)
    cache_key = req.prompt_cache_key
    names_pool = cache_key is not None and ctx.engine.snapshot.pool(cache_key) is not None
    if names_pool and req.pool_ref() is None:
        req.pool_id = cache_key
    if identity.session is None:
        key = None if names_pool else cache_key
        identity = dataclasses.replace(identity, session=key or earlier_session or response_id)
    keeps = kept_prefix.keeps(ctx, cache_key is not None, req.pool_ref() is not None)
    chat, history, n_kept = await offload(
        request, body_bytes(request), _prepare, ctx, req, earlier, keeps, inline=False
    )
    sink = QueueSink(asyncio.get_running_loop(), req.stream, ctx.settings.stream_interval_s)
    limit = -1 if req.max_output_tokens is None else req.max_output_tokens
    task = task_from(
        req,
        chat.prompt,
        limit,
        request,
        sink,
        grammar=chat.grammar,
        preserved=chat.preserved,
        identity=identity,
    )
    session = identity.session
    assert session is not None

    def keep(turn: ChatMessage) -> None:
        kept = (*history, turn)
        ctx.responses.put(tenant, response_id, Stored(session, kept, size_of(kept)))

    part = await kept_prefix.keep(request, task, n_kept, None)
    model = req.model or ctx.model_name
    wire = ResponsesWire(response_id, model, req, chat.parser(), keep, task, part)
    return await run(request, ctx, req, task, sink, wire)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/responses", responses)
