"""OpenTelemetry traces across router, engine and operator: opt-in, and W3C trace context
on the wire between them.

Tracing is on when an OTLP endpoint is configured with the standard variables
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; the exporter
speaks OTLP over HTTP/protobuf, ``OTEL_SERVICE_NAME`` overrides the service name, the
``OTEL_BSP_*`` variables tune batching). Off, the processes keep OpenTelemetry's no-op
tracer: nothing is recorded or sent, and a client's ``traceparent`` still passes through
the router to the engine. The SDK is imported only when tracing is on.

Session ids never appear in a span: ``session_hash`` stands for them (the same session,
the same hash, per tenant), as metrics never carry them either.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    return any(env.get(name) for name in ENDPOINT_VARS)


def setup(service: str, env: Mapping[str, str] = os.environ) -> bool:
    """Install the OTLP exporter as the global tracer provider when an endpoint is
    configured; returns whether tracing is on."""
    if not enabled(env):
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def shutdown() -> None:
    """Send what is batched (at process exit)."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    stop = getattr(provider, "shutdown", None)
    if stop is not None:
        stop()


def session_hash(tenant: str, session: str) -> str:
    """What a span says instead of a session id."""
    return hashlib.sha256(f"{tenant}\0{session}".encode()).hexdigest()[:16]
