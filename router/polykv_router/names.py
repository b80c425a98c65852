"""Strings other programs see: headers, labels, routes. Spelled once, here."""

from __future__ import annotations

SESSION_HEADER = "x-session-id"
"""The continuation key a client sends (the body's ``session_id`` wins, as on the engine)."""

REHOMED_HEADER = "x-polykv-rehomed"
"""Set by the router only, on a continuation it moved to another replica: the engine admits
it without the gate and counts it. A client's own copy of the header is dropped."""

REPLICA_HEADER = "x-polykv-replica"
"""On every forwarded response: the name of the engine pod that answered."""

MAX_SESSION_ID = 256
"""The engine refuses longer session ids; the router refuses them before routing."""

INFERENCE_PATHS = (
    "/completion",
    "/completions",
    "/v1/completions",
    "/v1/chat/completions",
    "/chat/completions",
)
"""POST routes that carry a session and a pool: routed by affinity and capacity."""

PASSTHROUGH_GET = ("/health", "/v1/health", "/props", "/slots", "/v1/models", "/models")
PASSTHROUGH_POST = ("/tokenize", "/detokenize")
"""Routes with no session: any serving replica answers (the least loaded)."""
