"""The three kinds as the API server serves them: names, printer columns, subresources."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from . import admission, engine, pool
from .admission import AdmissionPolicySpec, AdmissionPolicyStatus
from .engine import PolyKVEngineSpec, PolyKVEngineStatus
from .meta import GROUP
from .pool import PolyKVPoolSpec, PolyKVPoolStatus


def _ready_column() -> dict[str, Any]:
    return {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    }


AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


@dataclass(frozen=True)
class Kind:
    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    description: str
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: tuple[dict[str, Any], ...]
    spec_rules: tuple[dict[str, str], ...] = ()
    scale: dict[str, str] | None = None
    required_spec: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


ENGINE = Kind(
    kind="PolyKVEngine",
    plural="polykvengines",
    singular="polykvengine",
    short_names=("pkve",),
    description="A fleet of PolyKV engine replicas (llama.cpp with shared-prefix KV pools) "
    "serving one model. The operator owns its Deployment and Service.",
    spec=PolyKVEngineSpec,
    status=PolyKVEngineStatus,
    columns=(
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Pools", "type": "integer", "jsonPath": ".status.pools"},
        {"name": "TPS", "type": "number", "jsonPath": ".status.meanActiveTps"},
        _ready_column(),
        AGE,
    ),
    spec_rules=tuple(engine.SPEC_RULES),
    scale={
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    },
)

POOL = Kind(
    kind="PolyKVPool",
    plural="polykvpools",
    singular="polykvpool",
    short_names=("pkvp", "kvpool"),
    description="A named, immutable shared prefix (system prompt, tools, briefing) kept in "
    "the KV cache of every replica of a PolyKVEngine. Pools form a tree: a child extends or "
    "branches from its parent's prefix; agents attach to a pool by name.",
    spec=PolyKVPoolSpec,
    status=PolyKVPoolStatus,
    columns=(
        {"name": "Path", "type": "string", "jsonPath": ".status.path"},
        {"name": "Len", "type": "integer", "jsonPath": ".status.prefixLen"},
        {"name": "D", "type": "integer", "jsonPath": ".status.branchPos"},
        {"name": "Sessions", "type": "integer", "jsonPath": ".status.sessions"},
        {"name": "TPS", "type": "number", "jsonPath": ".status.meanActiveTps"},
        {"name": "Pressure", "type": "number", "jsonPath": ".status.compactionPressure"},
        _ready_column(),
        AGE,
    ),
    spec_rules=tuple(pool.SPEC_RULES),
)

ADMISSION = Kind(
    kind="AdmissionPolicy",
    plural="admissionpolicies",
    singular="admissionpolicy",
    short_names=("pkvap",),
    description="A per-session decode-speed floor (tokens/s) for PolyKVPools, enforced or "
    "advised by the engines that hold them. Not related to Kubernetes' "
    "ValidatingAdmissionPolicy: it admits agent sessions, not API requests.",
    spec=AdmissionPolicySpec,
    status=AdmissionPolicyStatus,
    columns=(
        {"name": "Target", "type": "number", "jsonPath": ".spec.targetTpsPerSession"},
        {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
        {"name": "Pools", "type": "integer", "jsonPath": ".status.appliedPools"},
        _ready_column(),
        AGE,
    ),
    spec_rules=tuple(admission.SPEC_RULES),
)

KINDS = (ENGINE, POOL, ADMISSION)
