"""The spans of one inference request (``polykv_api.tracing`` turns tracing on).

A request span (kind SERVER, a child of the caller's ``traceparent``: the router's) with
the GenAI semantic-convention attributes, PolyKV's pool, cached tokens and hashed session,
and four children: ``polykv.gate`` (the admission gate), ``polykv.queue`` (waiting for a
slot), ``polykv.prefill`` and ``polykv.decode``. The last three are drawn from the engine's
own timings when the request finishes (its prefill and decode durations, counted back from
the moment its answer arrived), so the engine thread records nothing. A pool create or fork
(an operator round's call) is a span ``polykv.pool.create`` in the round's trace.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from polykv_api.tracing import session_hash
from polykv_engine.core.tasks import GenerateTask, GenerationResult

TRACER = trace.get_tracer("polykv.engine")
FINISH = {"eos": "stop", "word": "stop", "limit": "length", "none": "stop"}


@contextmanager
def server_span(
    headers: Mapping[str, str], name: str, attributes: Mapping[str, Any]
) -> Iterator[Span]:
    """A span for a call, continuing the caller's trace (W3C ``traceparent``: the router's
    request, an operator round's pool create)."""
    parent = propagate.extract(headers)
    with TRACER.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span


def request_span(
    headers: Mapping[str, str], operation: str, model: str, attributes: Mapping[str, Any]
) -> AbstractContextManager[Span]:
    """An inference request's span, with the GenAI attributes."""
    attrs = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "polykv",
             "gen_ai.request.model": model, **attributes}  # fmt: skip
    return server_span(headers, f"{operation} {model}", attrs)


def record_done(
    span: Span,
    task: GenerateTask,
    result: GenerationResult,
    submitted_ns: int,
    done_ns: int,
    tracer: trace.Tracer = TRACER,
) -> None:
    """The request's outcome on its span, and its queue, prefill and decode as children."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            "gen_ai.usage.input_tokens": result.n_prompt_tokens,
            "gen_ai.usage.output_tokens": result.predicted_n,
            "gen_ai.response.finish_reasons": [FINISH[result.stop_type]],
            "polykv.cached_tokens": result.cache_n,
            "polykv.slot": result.slot,
        }
    )
    if result.pool_id is not None:
        span.set_attribute("polykv.pool.id", result.pool_id)
        span.set_attribute("polykv.pool.shared_tokens", result.shared_prefix)
    if task.session_id is not None:
        span.set_attribute("polykv.session.hash", session_hash(task.tenant, task.session_id))
    end = done_ns
    decode_start = end - int(result.predicted_ms * 1e6)
    prefill_start = max(submitted_ns, decode_start - int(result.prompt_ms * 1e6))
    ctx = trace.set_span_in_context(span)
    prefill = {
        "polykv.prompt_tokens_computed": result.prompt_n,
        "polykv.cached_tokens": result.cache_n,
    }
    phases: list[tuple[str, int, int, dict[str, Any]]] = [
        ("polykv.queue", submitted_ns, prefill_start, {}),
        ("polykv.prefill", prefill_start, decode_start, prefill),
        ("polykv.decode", decode_start, end, {"gen_ai.usage.output_tokens": result.predicted_n}),
    ]
    for name, start, stop, attrs in phases:
        child = tracer.start_span(name, context=ctx, start_time=start, attributes=attrs)
        child.end(end_time=max(start, stop))


def record_error(span: Span, status: int, reason: str) -> None:
    span.set_attribute("http.response.status_code", status)
    span.set_attribute("error.type", reason)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, reason))
