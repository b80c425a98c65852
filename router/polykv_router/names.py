"""Strings other programs see: headers, labels, routes. Spelled once, here."""

from __future__ import annotations

SESSION_HEADER = "x-session-id"
"""The continuation key a client sends (the body's ``session_id`` wins, as on the engine)."""

REHOMED_HEADER = "x-polykv-rehomed"
"""Set by the router only, on a continuation it moved to another replica: the engine admits
it without the gate and counts it. A client's own copy of the header is dropped."""

ROUTER_KEY_HEADER = "x-polykv-router-key"
"""The router's identity, on every request it proxies (``POLYKV_ROUTER_KEY``): the engine
honours ``x-polykv-rehomed`` only with it. A client's own copy of the header is dropped."""

REPLICA_HEADER = "x-polykv-replica"
"""On every forwarded answer that is not a refusal: the name of the engine pod that answered
(a 401, 403, 429 or 5xx names no replica)."""

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

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
"""Open on the engine too (probes carry no key): the only routes relayed without a key check."""
