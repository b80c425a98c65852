"""The engine's spans of one request, with the SDK's in-memory exporter (no model): queue,
prefill and decode drawn from the engine's timings, in order, inside the request span,
with the GenAI attributes and a hashed session."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from polykv_api.tracing import enabled, session_hash
from polykv_engine.core.tasks import GenerateTask, GenerationResult
from polykv_engine.http.tracing import record_done
from polykv_engine.llama.sampling import SamplingParams, StopParams


class _Sink:
    def emit(self, event: object) -> None: ...

    def flush(self) -> None: ...


def test_request_span_children_and_attributes() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    task = GenerateTask(
        prompt=[1, 2, 3], sampling=SamplingParams(), stop=StopParams(n_predict=8),
        sink=_Sink(), session_id="agent-7", tenant="crew",
    )  # fmt: skip
    result = GenerationResult(
        content="hi", tokens=[], stop_type="limit", stopping_word="", truncated=False, slot=1,
        session_id="agent-7", seed=0, prompt_n=40, cache_n=960, predicted_n=8, prompt_ms=200.0,
        predicted_ms=100.0, tps_ewma=80.0, pool_id=3, shared_prefix=900,
    )  # fmt: skip
    submitted = time.time_ns() - 500_000_000  # half a second ago: 200 ms of it in the queue
    with tracer.start_as_current_span("chat m") as span:
        record_done(span, task, result, submitted, time.time_ns(), tracer)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request = spans["chat m"]
    queue, prefill, decode = (spans[f"polykv.{n}"] for n in ("queue", "prefill", "decode"))
    for child in (queue, prefill, decode):
        assert child.parent is not None and child.parent.span_id == request.context.span_id
    assert queue.start_time == submitted
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert abs((prefill.end_time - prefill.start_time) - 200_000_000) < 1000
    assert abs((decode.end_time - decode.start_time) - 100_000_000) < 1000
    a = dict(request.attributes or {})
    assert a["gen_ai.usage.input_tokens"] == 1000 and a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["polykv.cached_tokens"] == 960 and a["polykv.pool.id"] == 3
    assert (
        a["polykv.session.hash"] == session_hash("crew", "agent-7") != session_hash("x", "agent-7")
    )
    assert "agent-7" not in str(a)


def test_tracing_is_opt_in() -> None:
    assert not enabled({})
    assert enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
