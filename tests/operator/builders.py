"""Small constructors for the operator's inputs (pools, policies, pods, engine specs)."""

from __future__ import annotations

from typing import Any

from polykv_operator.api import AdmissionPolicySpec, PolyKVEngineSpec, PolyKVPoolSpec
from polykv_operator.fleet import ReplicaRef
from polykv_operator.policies import PolicyNode
from polykv_operator.tree import PoolNode

NS = "agents"


def pool(
    name: str,
    engine: str = "eng",
    parent: str | None = None,
    labels: dict[str, str] | None = None,
    deleting: bool = False,
    **spec: Any,
) -> PoolNode:
    body: dict[str, Any] = {"engineRef": {"name": engine}, **spec}
    if parent is not None:
        body["parent"] = parent
    if not any(k in body for k in ("text", "appendText", "messages", "appendMessages", "tokens")):
        body["text"] = f"prefix of {name}"
    return PoolNode(
        namespace=NS,
        name=name,
        uid=f"uid-{name}",
        spec=PolyKVPoolSpec.model_validate(body),
        labels=labels or {},
        deleting=deleting,
    )


def policy(name: str, **spec: Any) -> PolicyNode:
    body = {"targetTpsPerSession": 5, **spec}
    return PolicyNode(NS, name, f"uid-{name}", AdmissionPolicySpec.model_validate(body))


def pod(
    name: str,
    ip: str | None,
    ready: bool = True,
    gate: str | None = None,
    restarts: int = 0,
    **kw: Any,
) -> ReplicaRef:
    return ReplicaRef(
        name=name,
        uid=f"uid-{name}",
        ip=ip,
        running=ready,
        ready=ready,
        gate=gate,
        restarts=restarts,
        **kw,
    )


def engine_spec(**kw: Any) -> PolyKVEngineSpec:
    body = {"model": {"path": "/models/m.gguf"}, **kw}
    return PolyKVEngineSpec.model_validate(body)
