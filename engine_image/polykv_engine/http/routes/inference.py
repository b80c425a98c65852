"""Inference routes: /completion, /v1/completions, /v1/chat/completions, /tokenize, /detokenize.

Handlers parse and validate at the edge, turn the request into a ``GenerateTask``, and relay
the engine's events as one JSON body or as SSE. A client that goes away cancels its task, so
its slot is freed at the next step.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from aiohttp import web

from polykv_api.agent_headers import AgentIdentity, HeaderError, agent_identity
from polykv_api.models import (
    ApplyTemplateRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    OAICompletionRequest,
    PoolRef,
    SamplingFields,
    TokenizeRequest,
)
from polykv_engine.chat.tools import ToolCallParser, ToolError, ToolPlan
from polykv_engine.chat.tools import plan as tool_plan
from polykv_engine.core import pool_ops
from polykv_engine.core.tasks import (
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateTask,
    GenerationResult,
    SpecParams,
    TokenEvent,
)
from polykv_engine.http import session_restore, tracing
from polykv_engine.http.app_context import AppContext, ctx_of
from polykv_engine.http.auth import identity_of
from polykv_engine.http.errors import ApiError, body_bytes, parse
from polykv_engine.http.mailbox import mailbox
from polykv_engine.http.offload import offload
from polykv_engine.http.responses import Logprobs, ResponseBuilder
from polykv_engine.http.sse import Wire, frame
from polykv_engine.ids import decimal
from polykv_engine.llama.grammar import ANY_JSON_OBJECT, CompiledGrammar, Grammar, GrammarError
from polykv_engine.llama.grammar import from_schema as grammar_from_schema
from polykv_engine.llama.sampling import SamplingParams, StopParams

log = logging.getLogger("polykv.http")

IGNORED_HEADER = "X-PolyKV-Ignored-Fields"
REHOMED_HEADER = "x-polykv-rehomed"  # set by polykv-router on a continuation it moved here


class QueueSink:
    """Carries engine events into the asyncio loop (``emit`` and ``flush`` run on the engine
    thread).

    Every hand-over wakes the loop, whose thread then takes a core from the compute threads
    mid-decode (and a router relaying the stream, another). So tokens wait on the engine side
    and travel together: a whole (non-streamed) response's with its final event, a stream's
    at most every ``interval_s`` (its first token at once; every token stays its own SSE
    event, several go out in one write). The engine flushes before a step that will take
    long (a prompt or pool chunk), so a held token never waits on someone else's prefill.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        stream: bool,
        interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mailbox = mailbox(loop)
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._stream = stream
        self._interval_s = interval_s
        self._clock = clock
        self._held: list[TokenEvent] = []
        self._posted_at = -math.inf
        self.submitted_ns = 0  # when the task went to the engine (its queue span starts)
        self.result: GenerationResult | None = None  # the outcome, once the loop has it
        self.done_ns = 0  # when the loop had it (the decode span ends)

    def finished(self, result: GenerationResult) -> GenerationResult:
        self.result, self.done_ns = result, time.time_ns()
        return result

    def emit(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self._held.append(event)
            if self._stream and self._clock() - self._posted_at >= self._interval_s:
                self.flush()
            return
        held, self._held = self._held, []
        self._mailbox.post(self.queue, *held, event)

    def flush(self) -> None:
        if self._stream and self._held:
            held, self._held = self._held, []
            self._posted_at = self._clock()
            self._mailbox.post(self.queue, *held)


def check_repeat_last_n(ctx: AppContext, req: SamplingFields) -> int:
    """``repeat_last_n`` as llama.cpp gets it: -1 is the slot's whole context (as in
    llama-server); more than the context would size a ring buffer for tokens that cannot
    exist (2**31 of them: 8 GiB, allocated on the engine thread)."""
    n_ctx = ctx.engine.snapshot.n_ctx_slot
    if req.repeat_last_n > n_ctx:
        raise ApiError(
            400,
            f"repeat_last_n: {req.repeat_last_n} is over the slot's context of {n_ctx} tokens "
            "(-1 means all of it)",
            reason="limit_exceeded",
        )
    return n_ctx if req.repeat_last_n == -1 else req.repeat_last_n


def _sampling(req: SamplingFields, grammar: Grammar | None, repeat_last_n: int) -> SamplingParams:
    return SamplingParams(
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        min_p=req.min_p,
        seed=req.seed,
        repeat_penalty=req.repeat_penalty,
        repeat_last_n=repeat_last_n,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        grammar=grammar,
    )


def _compiled(ctx: AppContext, grammar: Grammar | None, field: str) -> CompiledGrammar | None:
    """The grammar within the bounds and parsed by llama.cpp, ready for a slot's sampler
    (a 400 naming the field and the problem otherwise). Never on the event loop: callers
    prepare grammar requests through ``offload`` with ``inline=False``."""
    if grammar is None:
        return None
    try:
        return ctx.rt.compile_grammar(grammar)
    except GrammarError as exc:
        raise ApiError(400, f"{field}: {exc}", reason=exc.reason) from exc


def _schema_grammar(schema: dict[str, Any], field: str) -> Grammar:
    try:
        return Grammar(grammar_from_schema(schema))
    except GrammarError as exc:
        raise ApiError(400, f"{field}: {exc}", reason=exc.reason) from exc


def task_from(
    req: SamplingFields,
    prompt: list[int],
    n_predict: int,
    request: web.Request,
    sink: QueueSink,
    grammar: CompiledGrammar | None = None,
    logprobs: int | None = None,
    preserved: frozenset[int] = frozenset(),
    stops: list[str] | None = None,
    identity: AgentIdentity | None = None,
) -> GenerateTask:
    """``identity``: who the request is, when the route knows more than its headers say
    (a Responses session from ``prompt_cache_key``); by default read from the headers."""
    if identity is None:
        identity = identity_of_agent(request, req.session_id)
    request[SESSION_FINAL] = identity.final
    cap = ctx_of(request).settings.n_predict
    engine = ctx_of(request).engine
    if cap >= 0 and not 0 <= n_predict <= cap:  # -n, as llama-server caps a request's
        n_predict = cap
    return GenerateTask(
        prompt=prompt,
        sampling=_sampling(
            req, grammar.grammar if grammar else None, check_repeat_last_n(ctx_of(request), req)
        ),
        grammar=grammar,
        stop=StopParams(
            n_predict=n_predict,
            stops=tuple(req.stop if stops is None else stops),
            ignore_eos=req.ignore_eos,
        ),
        logprobs=logprobs,
        preserved_tokens=preserved,
        sink=sink,
        session_id=identity.session,
        tenant=identity_of(request).tenant,
        id_slot=req.id_slot,
        cache_prompt=req.cache_prompt,
        pool_ref=_pool_ref(req),
        pool_p=req.shared_prefix_n_tokens,
        spec=_spec(engine.cfg.spec, req, engine.cfg.draft_model is not None),
    )


def _spec(default: SpecParams, req: SamplingFields, has_draft_model: bool) -> SpecParams | None:
    """The request's speculative settings over the engine's; None: the engine's as is."""
    if req.spec_type is None and req.spec_n_max is None and req.spec_n_min is None:
        return None
    if req.spec_type == "draft" and not has_draft_model:
        raise ApiError(
            400,
            "speculative.type: draft needs a draft model; this engine was started without "
            "-md/--spec-draft-model",
            reason="not_supported",
        )
    return SpecParams(
        type=req.spec_type or default.type,
        n_max=default.n_max if req.spec_n_max is None else req.spec_n_max,
        n_min=default.n_min if req.spec_n_min is None else req.spec_n_min,
    )


SESSION_FINAL = "polykv.session_final"  # request key: release the session after this turn


def identity_of_agent(request: web.Request, body_session: str | None) -> AgentIdentity:
    """Session, parent and "final" from the body and the configured agent headers."""
    try:
        return agent_identity(
            request.headers, ctx_of(request).settings.session_headers, body_session
        )
    except HeaderError as exc:
        raise ApiError(400, str(exc)) from exc


async def release_session(ctx: AppContext, tenant: str, session_id: str) -> None:
    """What was kept for a session that said its turn was the last: its cache (on the
    engine thread) and its stored responses."""
    ctx.responses.forget_session(tenant, session_id)
    released = await asyncio.wrap_future(
        ctx.engine.call(lambda e: pool_ops.release_session(e, tenant, session_id))
    )
    log.info("session final: released %d cached tokens", released)


def _pool_ref(req: SamplingFields) -> PoolRef | None:
    ref = req.pool_ref()
    if isinstance(ref, str) and (number := decimal(ref)) is not None:
        return number
    if req.shared_prefix_n_tokens is not None and ref is None:
        raise ApiError(400, "shared_prefix_n_tokens needs pool_id (or shared_pool_slot)")
    return ref


def _headers(
    ctx: AppContext,
    req: SamplingFields,
    task: GenerateTask,
    result: GenerationResult | None = None,
) -> dict[str, str]:
    """Known once the task holds a slot: its first event has arrived. The PolyKV signals
    travel as headers because OpenAI clients (ChatOpenAI among them) drop body fields they
    do not know: at the start of a stream they describe the session before this turn."""
    headers: dict[str, str] = {}
    snap = ctx.engine.snapshot
    if 0 <= task.slot_id < len(snap.slots):
        slot = snap.slots[task.slot_id]
        tps = result.tps_ewma if result is not None else task.prev_tps
        headers["x-session-tps"] = f"{tps:.2f}"
        headers["x-polykv-ctx-headroom"] = str(max(0, slot.n_ctx - slot.ctx_used))
        assert ctx.gate is not None
        pressure = ctx.gate.compaction_pressure(snap.pool(task.pool.pool_id) if task.pool else None)
        headers["x-polykv-compaction-pressure"] = f"{pressure:.3f}"
    ignored = req.ignored_fields()
    if ignored:  # names come from the client: percent-encoded, never raw into a header
        headers[IGNORED_HEADER] = ",".join(quote(name, safe="") for name in ignored)
    if task.session_id:
        headers["x-session-id"] = task.session_id
    if task.pool is not None:
        headers["x-pool-id"] = str(task.pool.pool_id)
        headers["x-cached-prefix-tokens"] = str(task.shared_prefix)
    if task.pool_fallback is not None:
        headers["x-pool-fallback"] = task.pool_fallback
    return headers


async def run(
    request: web.Request,
    ctx: AppContext,
    req: SamplingFields,
    task: GenerateTask,
    sink: QueueSink,
    builder: Wire,
    include_usage: bool = False,
) -> web.StreamResponse:
    if ctx.draining:
        raise ApiError(
            503, "server is shutting down", headers={"Retry-After": "5"}, reason="shutting_down"
        )
    # No await since the draining check: the drain sees this request.
    with (
        ctx.owed(),
        tracing.request_span(
            request.headers, builder.operation, builder.model, _request_attributes(task)
        ) as span,
    ):
        try:
            resp = await _gated_run(request, ctx, req, task, sink, builder, include_usage)
        except ApiError as exc:
            tracing.record_error(span, exc.status, exc.reason)
            raise
        if sink.result is not None:
            tracing.record_done(span, task, sink.result, sink.submitted_ns, sink.done_ns)
    if request.get(SESSION_FINAL) and task.session_id is not None:
        await release_session(ctx, task.tenant, task.session_id)
    return resp


def _request_attributes(task: GenerateTask) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.request.temperature": task.sampling.temperature,
        "gen_ai.request.top_p": task.sampling.top_p,
    }
    if task.stop.n_predict >= 0:
        attrs["gen_ai.request.max_tokens"] = task.stop.n_predict
    if task.pool_ref is not None:
        attrs["polykv.pool.ref"] = str(task.pool_ref)
    return attrs


async def _gated_run(
    request: web.Request,
    ctx: AppContext,
    req: SamplingFields,
    task: GenerateTask,
    sink: QueueSink,
    builder: Wire,
    include_usage: bool,
) -> web.StreamResponse:
    """Admission, the engine's work and the answer: a request the drain waits for."""
    assert ctx.gate is not None
    # Read before the gate holds anything for the task (a client gone meanwhile leaks nothing).
    task.restore = await session_restore.saved_cache(ctx, task)
    if ctx.gate.queue_full():  # queued in the engine, or held by the gate
        raise ctx.gate.refuse_full_queue(task)
    rehomed = request.headers.get(REHOMED_HEADER, "") in ("1", "true")
    overcommit, rehomed = ctx.gate.trusted_overrides(
        req.overcommit, rehomed, identity_of(request).trusted
    )
    with tracing.TRACER.start_as_current_span("polykv.gate"):
        extra_headers = await ctx.gate.admit(task, overcommit, rehomed)
    sink.submitted_ns = time.time_ns()
    ctx.engine.submit(task)
    done = False
    try:
        if req.stream:
            resp = await _stream(
                request, ctx, req, task, sink, builder, include_usage, extra_headers
            )
        else:
            resp = await _whole(ctx, req, task, sink, builder, extra_headers)
        done = True
        return resp
    except ApiError as exc:
        if exc.reason == "queue_full":  # turned away: demand the autoscaler must see
            ctx.gate.record_refusal(task, None)
        raise
    finally:
        ctx.gate.finished(task)
        if not done:
            # Client gone (handler cancelled) or write failed: free the slot now.
            ctx.engine.cancel(task.task_id)


async def _whole(
    ctx: AppContext,
    req: SamplingFields,
    task: GenerateTask,
    sink: QueueSink,
    builder: Wire,
    extra_headers: dict[str, str],
) -> web.Response:
    events: list[TokenEvent] = []
    while True:
        ev = await sink.queue.get()
        if isinstance(ev, TokenEvent):
            events.append(ev)
        elif isinstance(ev, DoneEvent):
            sink.finished(ev.result)
            return web.json_response(
                builder.final(ev.result, events),
                headers={**_headers(ctx, req, task, ev.result), **extra_headers},
            )
        else:
            raise _api_error(ev)


def _api_error(ev: ErrorEvent) -> ApiError:
    headers = {"Retry-After": str(ev.retry_after)} if ev.retry_after is not None else None
    return ApiError(ev.status, ev.message, ev.type, headers=headers, reason=ev.reason)


async def _stream(
    request: web.Request,
    ctx: AppContext,
    req: SamplingFields,
    task: GenerateTask,
    sink: QueueSink,
    builder: Wire,
    include_usage: bool,
    extra_headers: dict[str, str],
) -> web.StreamResponse:
    # Wait for the first event before sending headers, so an error before any token
    # (e.g. a full KV cache) is still a proper HTTP status instead of an SSE error event.
    # A request still queued after a ping interval gets its headers and keep-alives instead.
    settings = ctx.settings
    try:
        first: Event | None = await asyncio.wait_for(sink.queue.get(), settings.sse_ping_interval_s)
    except TimeoutError:
        first = None
    if isinstance(first, ErrorEvent):
        raise _api_error(first)
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            **_headers(ctx, req, task),
            **extra_headers,
        }
    )
    await resp.prepare(request)
    opening = [frame(p) for p in builder.stream_start(task)]

    async def send(data: bytes) -> None:
        # A peer that stopped reading (half-open, gone) blocks the write: give up on it.
        # (asyncio.timeout, not wait_for: no task per token on the loop that shares the
        # cores with the compute threads.)
        async with asyncio.timeout(settings.write_timeout_s):
            await resp.write(data)

    async def next_event() -> Event | None:
        try:
            async with asyncio.timeout(settings.sse_ping_interval_s):
                return await sink.queue.get()
        except TimeoutError:
            return None

    ev: Event | None = first
    result: GenerationResult | None = None
    while True:
        out, opening = opening, []
        if ev is None:
            out.append(builder.keepalive)
        while isinstance(ev, TokenEvent):  # every token already here goes in one write
            out.extend(frame(chunk) for chunk in builder.chunks(ev))
            ev = sink.queue.get_nowait() if not sink.queue.empty() else None
            if ev is None:
                break
        if isinstance(ev, DoneEvent):
            result = sink.finished(ev.result)
            out.extend(frame(final) for final in builder.stream_final(result))
        elif isinstance(ev, ErrorEvent):
            out.extend(frame(p) for p in builder.stream_error(_api_error(ev)))
        if out:
            await send(b"".join(out))
        if isinstance(ev, DoneEvent | ErrorEvent):
            break
        ev = await next_event()
    tail = builder.stream_tail(result, include_usage)
    if tail:
        await send(b"".join(frame(p) for p in tail))
    await resp.write_eof()
    return resp


# ---------------------------------------------------------------------------- handlers


async def completion(request: web.Request) -> web.StreamResponse:
    """llama-server's native completion route."""
    ctx = ctx_of(request)
    req = await parse(request, CompletionRequest)
    if req.grammar is not None and req.json_schema is not None:
        raise ApiError(400, "give grammar or json_schema, not both")
    check_repeat_last_n(ctx, req)

    def prepare() -> tuple[CompiledGrammar | None, list[int]]:
        grammar = Grammar(req.grammar) if req.grammar is not None else None
        if req.json_schema is not None:
            grammar = _schema_grammar(req.json_schema, "json_schema")
        field = "grammar" if req.grammar is not None else "json_schema"
        return _compiled(ctx, grammar, field), ctx.tokenize_prompt(req.prompt)

    plain = req.grammar is None and req.json_schema is None
    grammar, prompt = await offload(request, body_bytes(request), prepare, inline=plain)
    sink = QueueSink(asyncio.get_running_loop(), req.stream, ctx.settings.stream_interval_s)
    task = task_from(
        req,
        prompt,
        req.limit(),
        request,
        sink,
        grammar=grammar,
        logprobs=req.n_probs if req.n_probs > 0 else None,
    )
    probs = Logprobs(ctx.token_piece) if req.n_probs > 0 else None
    builder = ResponseBuilder("completion", ctx.model_name, logprobs=probs)
    return await run(request, ctx, req, task, sink, builder)


async def oai_completion(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    req = await parse(request, OAICompletionRequest)
    check_repeat_last_n(ctx, req)
    prompt = await offload(request, body_bytes(request), ctx.tokenize_prompt, req.prompt)
    sink = QueueSink(asyncio.get_running_loop(), req.stream, ctx.settings.stream_interval_s)
    n_predict = -1 if req.max_tokens is None else req.max_tokens
    task = task_from(req, prompt, n_predict, request, sink, logprobs=req.logprobs)
    echo = req.prompt if req.echo and isinstance(req.prompt, str) else None
    probs = Logprobs(ctx.token_piece) if req.logprobs is not None else None
    builder = ResponseBuilder("oai_completion", req.model or ctx.model_name, echo, logprobs=probs)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return await run(request, ctx, req, task, sink, builder, usage)


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request made ready for the engine: tool plan, grammar, prompt tokens."""

    plan: ToolPlan | None
    grammar: CompiledGrammar | None
    prompt: list[int]
    preserved: frozenset[int]  # special tokens the output shows as text (tool markers)
    text: str  # the rendered prompt

    def parser(self) -> ToolCallParser | None:
        plan = self.plan
        return ToolCallParser(plan.fmt) if plan is not None and plan.parse else None


OutputSchema = tuple[dict[str, Any] | None, str]
"""A constraint on the reply: the JSON schema (None: any JSON object), and its field."""


def prepare_chat(
    ctx: AppContext,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    output: OutputSchema | None = None,
    template_kwargs: dict[str, Any] | None = None,
    must_fit: bool = True,
) -> PreparedChat:
    """Tools planned, grammars compiled and checked, the template rendered and tokenized:
    the heavy part of every chat route, run off the event loop (``offload`` with
    ``inline=False``: a tool or schema grammar is parsed here however small the body).
    ``must_fit``: a prompt longer than a slot's context is refused (400
    ``prompt_too_long``); a count takes it as it is."""
    try:
        plan = tool_plan(ctx.tool_format, tools, tool_choice, parallel_tool_calls)
    except ToolError as exc:
        raise ApiError(400, str(exc)) from exc
    except GrammarError as exc:
        raise ApiError(400, f"tools: {exc}", reason=exc.reason) from exc
    grammar, field = None, "tools"
    if output is not None:
        schema, field = output
        grammar = Grammar(ANY_JSON_OBJECT) if schema is None else _schema_grammar(schema, field)
        if plan is not None and plan.mode != "none":
            name = field.split(".")[0]
            raise ApiError(400, f"{name} with tools: constrain one or the other, not both")
    if plan is not None and grammar is None:
        grammar = plan.grammar
    compiled = _compiled(ctx, grammar, field)
    text = ctx.render_messages(messages, tools, True, template_kwargs)
    prompt = ctx.rt.tokenize(text, add_special=True, parse_special=True)
    if must_fit:
        ctx.check_prompt_fits(prompt)
    preserved = ctx.special_tokens(plan.markers) if plan is not None else frozenset()
    return PreparedChat(plan, compiled, prompt, preserved, text)


def _response_format(req: ChatCompletionRequest) -> OutputSchema | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    schema, field = fmt.schema_field()
    return schema, field if schema is not None else "response_format"


async def oai_chat(request: web.Request) -> web.StreamResponse:
    ctx = ctx_of(request)
    req = await parse(request, ChatCompletionRequest)
    check_repeat_last_n(ctx, req)
    chat = await offload(
        request,
        body_bytes(request),
        prepare_chat,
        ctx,
        req.messages,
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        _response_format(req),
        req.chat_template_kwargs,
        inline=False,
    )
    sink = QueueSink(asyncio.get_running_loop(), req.stream, ctx.settings.stream_interval_s)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    task = task_from(
        req,
        chat.prompt,
        -1 if limit is None else limit,
        request,
        sink,
        grammar=chat.grammar,
        logprobs=req.top_logprobs if req.logprobs else None,
        preserved=chat.preserved,
    )
    probs = Logprobs(ctx.token_piece) if req.logprobs else None
    model = req.model or ctx.model_name
    builder = ResponseBuilder("oai_chat", model, tools=chat.parser(), logprobs=probs)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return await run(request, ctx, req, task, sink, builder, usage)


async def apply_template(request: web.Request) -> web.Response:
    """llama-server's ``/apply-template``: the prompt a chat request would be given."""
    ctx = ctx_of(request)
    req = await parse(request, ApplyTemplateRequest)
    text = await offload(
        request,
        body_bytes(request),
        ctx.render_messages,
        req.messages,
        req.tools,
        True,
        req.chat_template_kwargs,
    )
    return web.json_response({"prompt": text})


def _json_text(body: Any) -> str:
    return json.dumps(body)  # as web.json_response writes it, here off the loop


def _tokenized(ctx: AppContext, req: TokenizeRequest) -> str:
    rt = ctx.rt
    tokens = rt.tokenize(req.content, req.add_special, req.parse_special)
    if not req.with_pieces:
        return _json_text({"tokens": tokens})
    # Written straight into one buffer, each distinct token encoded once: a dict per token
    # held ~170 bytes of Python objects per byte of the body (a 2.25 MiB body, the default
    # limit at -c 4096: 393 MiB; at -c 131072, gigabytes).
    known: dict[int, str] = {}
    out = io.StringIO()
    out.write('{"tokens": [')
    for i, t in enumerate(tokens):
        item = known.get(t)
        if item is None:
            raw = rt.token_bytes(t, special=True)
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # a fragment of a multi-byte character: bytes, as llama-server
            item = known[t] = json.dumps({"id": t, "piece": piece})
        out.write(f", {item}" if i else item)
    out.write("]}")
    return out.getvalue()


async def tokenize(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    req = await parse(request, TokenizeRequest)
    ctx.require_ready()
    text = await offload(request, body_bytes(request), _tokenized, ctx, req)
    return web.Response(text=text, content_type="application/json")


def _detokenized(ctx: AppContext, req: DetokenizeRequest) -> str:
    ctx.check_token_ids(req.tokens)
    return _json_text({"content": ctx.rt.detokenize(req.tokens, special=True)})


async def detokenize(request: web.Request) -> web.Response:
    ctx = ctx_of(request)
    req = await parse(request, DetokenizeRequest)
    ctx.require_ready()
    text = await offload(request, body_bytes(request), _detokenized, ctx, req)
    return web.Response(text=text, content_type="application/json")


def add_routes(app: web.Application) -> None:
    for path in ("/completion", "/completions"):
        app.router.add_post(path, completion)
    app.router.add_post("/v1/completions", oai_completion)
    for path in ("/v1/chat/completions", "/chat/completions"):
        app.router.add_post(path, oai_chat)
    app.router.add_post("/apply-template", apply_template)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
