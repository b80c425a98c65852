"""The operator's rounds as spans, with the SDK's in-memory exporter: one span a round,
naming the engine fleet, and every call the round makes to a replica carries the round's
trace as W3C ``traceparent`` (the engine's spans join it). With tracing off nothing is
added to the calls."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from polykv_operator import engine_loop
from polykv_operator.engine_client import engine_http

from .builders import NS
from .fake_engine import FakeFleet
from .test_engine_loop import Loop
from .test_engine_round import Harness, tree


class _Recording(httpx.AsyncBaseTransport):
    """The fake replicas' transport, keeping the headers of every request."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.seen: list[tuple[str, httpx.Headers]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((f"{request.method} {request.url.path}", request.headers))
        return await self.inner.handle_async_request(request)


def _harness() -> tuple[Harness, _Recording]:
    h = Harness(2)
    recording = _Recording(FakeFleet(h.engines).transport())
    h.http = engine_http(recording)
    return h, recording


def _first_round(h: Harness) -> None:
    loop = Loop(h, tree())

    async def scenario() -> None:
        try:
            await loop.until(lambda: h.state.rounds_done >= 1)
        finally:
            loop.stop()

    asyncio.run(scenario())


def test_a_round_is_a_span_and_its_engine_calls_carry_its_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(engine_loop, "TRACER", provider.get_tracer("polykv.operator"))
    h, recording = _harness()
    _first_round(h)

    rounds = [s for s in exporter.get_finished_spans() if s.name == "polykv.operator.round"]
    assert rounds, exporter.get_finished_spans()
    first = rounds[0]
    assert first.attributes is not None
    assert dict(first.attributes) == {"k8s.namespace.name": NS, "polykv.engine": "eng"}
    ctx = first.get_span_context()
    assert ctx is not None
    ours = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-"  # then the flags
    in_round = [(call, headers) for call, headers in recording.seen
                if headers.get("traceparent", "").startswith(ours)]  # fmt: skip
    # The round listed both replicas and created the tree's three pools on each (a root,
    # then its two children through the fork route; dry runs besides).
    calls = [call for call, _ in in_round]
    assert calls.count("GET /polykv/pools") >= 2, recording.seen
    assert calls.count("POST /polykv/pools/root/fork") >= 4, calls
    # Calls outside a round (none here but quiet checks) carry no trace of their own.
    assert all(h.get("traceparent", ours).startswith(ours) for _, h in recording.seen)


def test_without_tracing_the_calls_carry_no_traceparent() -> None:
    h, recording = _harness()
    _first_round(h)
    assert recording.seen and not any("traceparent" in h for _, h in recording.seen)
