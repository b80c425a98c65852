"""OpenTelemetry traces from router to engine, as a collector receives them: a real engine
and a real router, each exporting OTLP/HTTP to a receiver in this test (it decodes what the
SDK's exporter sends). One client ``traceparent`` in; one trace out, whose spans show
routing, the forward, the engine's gate, queue, prefill and decode, with the GenAI
attributes and no session id in clear."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from polykv_api.tracing import session_hash
from polykv_engine.testing import EngineProcess
from polykv_testenv.waiting import wait_for

from .helpers import RouterProcess

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_BSP_EXPORT_TIMEOUT": "5000"}


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps every span with its service's name."""

    server: Any

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            service = next(
                a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
            )
            for ss in rs.scope_spans:
                for span in ss.spans:
                    with self.server.lock:
                        self.server.spans.append((service, span))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.spans = []  # type: ignore[attr-defined]
    server.lock = threading.Lock()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = (
            [v.string_value for v in value.array_value.values]
            if kind == "array_value"
            else getattr(value, kind)
        )
    return out


def test_one_trace_from_router_to_engine(
    collector: ThreadingHTTPServer, test_model: Path, tmp_path: Path
) -> None:
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **FAST_EXPORT}
    engine = EngineProcess(
        test_model, ("-np", "2", "-c", "2048"), log_path=tmp_path / "engine.log", env=env
    )
    engine.start(timeout=120)
    router = RouterProcess({"a": engine.base_url}, tmp_path / "router.log", env=env)
    try:
        router.start()
        headers = {
            "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01",
            "x-session-id": "traced-session",
        }
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        r = httpx.post(f"{router.base_url}/v1/chat/completions", json=body, headers=headers,
                       timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text

        def spans() -> dict[str, tuple[str, Any]] | None:
            with collector.lock:  # type: ignore[attr-defined]
                every = list(collector.spans)  # type: ignore[attr-defined]
            ours = [(s, sp) for s, sp in every if sp.trace_id.hex() == TRACE_ID]
            by_name = {sp.name: (s, sp) for s, sp in ours}
            want = {"polykv.route", "polykv.forward", "polykv.gate", "polykv.queue",
                    "polykv.prefill", "polykv.decode"}  # fmt: skip
            return by_name if want <= by_name.keys() and len(by_name) >= 7 else None

        found = wait_for("every span exported", spans, timeout_s=60)
    finally:
        router.stop()
        engine.stop()

    route_svc, route = found["polykv.route"]
    assert route_svc == "polykv-router" and route.parent_span_id.hex() == CLIENT_SPAN
    _, forward = found["polykv.forward"]
    assert forward.parent_span_id == route.span_id
    assert attrs(forward)["polykv.replica"] == "a"
    (request_name,) = [n for n, (svc, _) in found.items() if svc == "polykv-engine"
                       and n.startswith("chat ")]  # fmt: skip
    _, request = found[request_name]
    assert request.parent_span_id == forward.span_id  # the router's context went through
    a = attrs(request)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "polykv"
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["polykv.session.hash"] == session_hash("open", "traced-session")  # the keyless tenant
    assert "traced-session" not in str(attrs(route)) + str(a)
    phases = [found[n][1] for n in ("polykv.queue", "polykv.prefill", "polykv.decode")]
    for phase in [found["polykv.gate"][1], *phases]:
        assert phase.parent_span_id == request.span_id
    for before, after in itertools.pairwise(phases):
        assert before.end_time_unix_nano <= after.start_time_unix_nano + 1
    assert request.start_time_unix_nano <= phases[0].start_time_unix_nano


def test_a_pool_create_joins_the_callers_trace(
    collector: ThreadingHTTPServer, test_model: Path, tmp_path: Path
) -> None:
    """What an operator round sends (its span as ``traceparent``) makes the engine's pool
    create a span of the round's trace."""
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **FAST_EXPORT}
    engine = EngineProcess(
        test_model, ("-np", "1", "-c", "1024"), log_path=tmp_path / "engine.log", env=env
    )
    engine.start(timeout=120)
    try:
        headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
        body = {"name": "traced-crew", "prompt": "You are the crew."}
        r = httpx.post(f"{engine.base_url}/polykv/pools", json=body, headers=headers, timeout=120)
        assert r.status_code == 201, r.text

        def create_span() -> Any:
            with collector.lock:  # type: ignore[attr-defined]
                every = list(collector.spans)  # type: ignore[attr-defined]
            found = [sp for _, sp in every if sp.name == "polykv.pool.create"]
            return found[0] if found else None

        span = wait_for("the pool create's span", create_span, timeout_s=60)
    finally:
        engine.stop()
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == CLIENT_SPAN
    a = attrs(span)
    assert a["polykv.pool.name"] == "traced-crew" and a["http.response.status_code"] == 201
