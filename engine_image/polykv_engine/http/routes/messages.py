"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

What Claude Code and the ``anthropic`` SDKs send is translated into the engine's chat form
(``chat/anthropic.py``), rendered with the model's template and run like any chat request:
the same bounds, the same off-loop preparation, admission gate, sessions and pools. Errors
take Anthropic's shape (``http/errors.py``). The ``?beta=true`` query and the
``anthropic-beta`` / ``anthropic-version`` headers are accepted and not needed.

A ``cache_control`` breakpoint keeps the prefix up to it (``http.kept_prefix``): the request
then attaches the tenant's kept prefix for it.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from polykv_api.anthropic import CountTokensRequest, MessagesRequest
from polykv_engine.chat.anthropic import chat_form, mark_last_breakpoint
from polykv_engine.chat.turns import ChatForm
from polykv_engine.http import kept_prefix
from polykv_engine.http.app_context import AppContext, ctx_of
from polykv_engine.http.errors import ApiError, body_bytes, parse
from polykv_engine.http.offload import offload
from polykv_engine.http.routes.inference import (
    OutputSchema,
    PreparedChat,
    QueueSink,
    check_repeat_last_n,
    prepare_chat,
    run,
    task_from,
)
from polykv_engine.http.wire_anthropic import MessagesWire


def _output(req: MessagesRequest) -> OutputSchema | None:
    fmt = req.output_config.format if req.output_config is not None else None
    return (fmt.schema_, "output_config.format.schema") if fmt is not None else None


def _form(req: MessagesRequest) -> ChatForm:
    try:
        return chat_form(req)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


def _prepare(ctx: AppContext, req: MessagesRequest, must_fit: bool = True) -> PreparedChat:
    form = _form(req)
    return prepare_chat(
        ctx,
        form.messages,
        form.tools,
        form.tool_choice,
        form.parallel_tool_calls,
        _output(req),
        must_fit=must_fit,
    )


def _prepare_kept(ctx: AppContext, req: MessagesRequest, keeps: bool) -> tuple[PreparedChat, int]:
    """The chat, and how many of its tokens the request's last breakpoint closes (0: none,
    or not kept)."""
    chat = _prepare(ctx, req)
    marked = mark_last_breakpoint(req) if keeps else None
    if marked is None:
        return chat, 0
    form = _form(marked)
    return chat, kept_prefix.prefix_len(ctx, chat.text, chat.prompt, form.messages, form.tools)


async def messages(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    req = await parse(request, MessagesRequest)
    check_repeat_last_n(ctx, req)
    ttl = req.cache_ttl()
    keeps = kept_prefix.keeps(ctx, ttl is not None, req.pool_ref() is not None)
    chat, n_kept = await offload(
        request, body_bytes(request), _prepare_kept, ctx, req, keeps, inline=False
    )
    sink = QueueSink(asyncio.get_running_loop(), req.stream, ctx.settings.stream_interval_s)
    task = task_from(
        req,
        chat.prompt,
        req.max_tokens,
        request,
        sink,
        grammar=chat.grammar,
        preserved=chat.preserved,
        stops=[*req.stop_sequences, *req.stop],
    )
    part = await kept_prefix.keep(request, task, n_kept, ttl)
    wire = MessagesWire(req.model or ctx.model_name, chat.parser(), part, task)
    return await run(request, ctx, req, task, sink, wire)


def _count(ctx: AppContext, req: CountTokensRequest) -> int:
    return len(_prepare(ctx, req, must_fit=False).prompt)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's length in tokens, as ``/v1/messages`` would render it: also past the
    context (that is what a client counts for), within the body limit."""
    ctx = ctx_of(request)
    req = await parse(request, CountTokensRequest)
    ctx.require_ready()
    n = await offload(request, body_bytes(request), _count, ctx, req, inline=False)
    return web.json_response({"input_tokens": n})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
