"""The documents of the operator's `external.metrics.k8s.io/v1beta1` API (pure).

What an HPA's External metric asks the API server, which forwards it to us:

    GET /apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/{metric}?labelSelector=...

The selector must name exactly one PolyKVEngine (`polykv.io/engine=<name>`), and the answer
holds exactly one item for it: the HPA adds up every item it gets, so one item per selector
is what makes `target.type: Value` mean the fleet's figure. A stale signal, an unknown
engine or a selector that names no single engine is an error (a Kubernetes Status), never an
empty list or a made-up value: the HPA then holds its replica count for that metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

from ..names import DEMAND_RATIO, ENGINE_LABEL, FLOOR_PRESSURE
from .aggregate import Signal

GROUP = "external.metrics.k8s.io"
VERSION = "v1beta1"
GROUP_VERSION = f"{GROUP}/{VERSION}"
APISERVICE_NAME = f"{VERSION}.{GROUP}"
ROOT = f"/apis/{GROUP_VERSION}"
METRICS = (FLOOR_PRESSURE, DEMAND_RATIO)

Doc = dict[str, Any]


class ApiError(Exception):
    """An answer that is a Kubernetes Status: `code`, `reason` (StatusReason), message."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def status(err: ApiError) -> Doc:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": err.message,
        "reason": err.reason,
        "code": err.code,
    }


def resource_list() -> Doc:
    """Discovery (`GET /apis/external.metrics.k8s.io/v1beta1`): what the aggregator's
    availability check reads, and what tells clients the metric names."""
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [
            {
                "name": name,
                "singularName": "",
                "namespaced": True,
                "kind": "ExternalMetricValueList",
                "verbs": ["get"],
            }
            for name in METRICS
        ],
    }


def openapi_v2() -> Doc:
    """A minimal document: the aggregator merges every server's; ours adds no paths."""
    return {"swagger": "2.0", "info": {"title": "polykv external metrics", "version": VERSION}}


def openapi_v3() -> Doc:
    return {"paths": {}}


@dataclass(frozen=True)
class MetricRequest:
    namespace: str
    metric: str
    engine: str


def parse_path(path: str) -> tuple[str, str]:
    """(namespace, metric) of `/apis/external.metrics.k8s.io/v1beta1/namespaces/NS/METRIC`."""
    parts = path.removeprefix(ROOT).strip("/").split("/")
    if len(parts) != 3 or parts[0] != "namespaces" or not parts[1] or not parts[2]:
        raise ApiError(404, "NotFound", f"no such path: {path}")
    return unquote(parts[1]), unquote(parts[2])


def engine_of(selector: str | None) -> str:
    """The one engine a label selector names: `polykv.io/engine=<name>` (`==`, or `in`
    with one value, too); other requirements alongside it are refused rather than ignored,
    since they would select nothing this API knows."""
    if not selector:
        raise ApiError(
            400, "BadRequest", f"labelSelector must name one engine: {ENGINE_LABEL}=<name>"
        )
    found: list[str] = []
    for req in _requirements(selector):
        key, op, values = req
        if key != ENGINE_LABEL or op not in ("=", "==", "in") or len(values) != 1:
            raise ApiError(
                400,
                "BadRequest",
                f"unsupported selector requirement {key!r}: select one engine with "
                f"{ENGINE_LABEL}=<name>",
            )
        found.append(values[0])
    if len(set(found)) != 1 or not found[0]:
        raise ApiError(400, "BadRequest", f"labelSelector must name one engine: {selector!r}")
    return found[0]


def _requirements(selector: str) -> list[tuple[str, str, list[str]]]:
    """Splits a selector string into (key, operator, values); `in (a)` keeps its values."""
    out: list[tuple[str, str, list[str]]] = []
    depth, start, items = 0, 0, []
    for i, ch in enumerate(selector):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(selector[start:i])
            start = i + 1
    items.append(selector[start:])
    for raw in (x.strip() for x in items):
        if " in " in raw or raw.endswith(")"):
            key, _, rest = raw.partition(" in ")
            inner = rest.strip()
            if not (inner.startswith("(") and inner.endswith(")")):
                raise ApiError(400, "BadRequest", f"cannot parse selector requirement {raw!r}")
            values = [v.strip() for v in inner[1:-1].split(",") if v.strip()]
            out.append((key.strip(), "in", values))
            continue
        for op in ("==", "!=", "="):
            if op in raw:
                key, _, value = raw.partition(op)
                out.append((key.strip(), op, [value.strip()]))
                break
        else:
            out.append((raw, "exists", []))
    return out


def quantity(value: float) -> str:
    """A Kubernetes quantity in thousandths (`830m`), whole numbers without a suffix."""
    if not math.isfinite(value):
        raise ValueError(f"not a finite value: {value}")
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def value_list(req: MetricRequest, signal: Signal | None) -> Doc:
    """The ExternalMetricValueList of one metric of one engine (one item), or ApiError."""
    if req.metric not in METRICS:
        raise ApiError(
            404, "NotFound", f"no external metric {req.metric!r}; served: {', '.join(METRICS)}"
        )
    if signal is None:
        raise ApiError(
            404,
            "NotFound",
            f"no figures for engine {req.namespace}/{req.engine}: the operator has not polled "
            "such an engine (it does not exist, or the operator has just started)",
        )
    value = signal.floor_pressure if req.metric == FLOOR_PRESSURE else signal.session_demand_ratio
    if value is None or signal.observed_at is None:
        raise ApiError(
            503,
            "ServiceUnavailable",
            f"{req.metric} of engine {req.namespace}/{req.engine} is stale: {signal.reason}",
        )
    return {
        "kind": "ExternalMetricValueList",
        "apiVersion": GROUP_VERSION,
        "metadata": {},
        "items": [
            {
                "metricName": req.metric,
                "metricLabels": {ENGINE_LABEL: req.engine},
                "timestamp": rfc3339(signal.observed_at),
                "value": quantity(value),
            }
        ],
    }
