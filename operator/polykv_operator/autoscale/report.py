"""One engine fleet's signal as a JSON document, for KEDA's `metrics-api` scaler (pure).

    GET /polykv/autoscale/{namespace}/{engine}

200 with numbers when fresh; 503 with `"stale": true`, null figures and the reason when not
(KEDA then counts a failure and, after its `failureThreshold`, applies its `fallback`), so a
scaler reading `floor_pressure` never acts on an old value. 404 for an engine the operator
has not polled.
"""

from __future__ import annotations

from typing import Any

from .aggregate import Signal

PREFIX = "/polykv/autoscale/"

Doc = dict[str, Any]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def document(namespace: str, engine: str, signal: Signal, now: float) -> tuple[int, Doc]:
    """(HTTP status, body) for a polled engine."""
    age = signal.age_s(now)
    body: Doc = {
        "namespace": namespace,
        "engine": engine,
        "floor_pressure": _round(signal.floor_pressure),
        "session_demand_ratio": _round(signal.session_demand_ratio),
        "stale": signal.stale,
        "reason": signal.reason,
        "age_seconds": None if age is None else round(age, 1),
        "replicas": list(signal.replicas),
        "sessions": {
            "active": signal.active,
            "refused": signal.refused,
            "headroom": signal.headroom,
        },
        "pools": {
            p.pool: {
                "floor": p.floor,
                "active_sessions": p.n_active,
                "active_tps_sum": round(p.tps_sum, 3),
                "floor_pressure": _round(p.floor_pressure),
            }
            for p in signal.pools
        },
    }
    return (503 if signal.stale else 200), body


def not_found(namespace: str, engine: str) -> tuple[int, Doc]:
    return 404, {
        "namespace": namespace,
        "engine": engine,
        "error": "the operator has not polled such an engine (it does not exist, or the "
        "operator has just started)",
    }


def parse_path(path: str) -> tuple[str, str] | None:
    """(namespace, engine) of `/polykv/autoscale/{namespace}/{engine}`; None otherwise."""
    if not path.startswith(PREFIX):
        return None
    parts = path[len(PREFIX) :].strip("/").split("/")
    if len(parts) != 2 or not all(parts):
        return None
    return parts[0], parts[1]
