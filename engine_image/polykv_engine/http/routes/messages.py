"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

What Claude Code and the ``anthropic`` SDKs send is translated into the engine's chat form
(``chat/anthropic.py``), rendered with the model's template and run like any chat request:
the same bounds, the same off-loop preparation, admission gate, sessions and pools. Errors
take Anthropic's shape (``http/errors.py``). The ``?beta=true`` query and the
``anthropic-beta`` / ``anthropic-version`` headers are accepted and not needed.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from polykv_api.anthropic import CountTokensRequest, MessagesRequest
from polykv_engine.chat.anthropic import chat_form
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


def _prepare(ctx: AppContext, req: MessagesRequest, must_fit: bool = True) -> PreparedChat:
    try:
        form = chat_form(req)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    return prepare_chat(
        ctx,
        form.messages,
        form.tools,
        form.tool_choice,
        form.parallel_tool_calls,
        _output(req),
        must_fit=must_fit,
    )


async def messages(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    req = await parse(request, MessagesRequest)
    check_repeat_last_n(ctx, req)
    chat = await offload(request, body_bytes(request), _prepare, ctx, req, inline=False)
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
    wire = MessagesWire(req.model or ctx.model_name, chat.parser(), req.has_cache_control())
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
