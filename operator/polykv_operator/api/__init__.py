"""The operator's API: pydantic models of the three kinds (the CRDs are generated from
these by ``python -m polykv_operator.crdgen``)."""

from .admission import AdmissionPolicySpec, AdmissionPolicyStatus, PolicyConflict
from .engine import (
    ModelInit,
    ModelSource,
    PolyKVEngineSpec,
    PolyKVEngineStatus,
    ReplicaStatus,
    RouterSpec,
    SnapshotSpec,
    SnapshotTotals,
)
from .meta import API_VERSION, CATEGORY, GROUP, VERSION, Condition, KubeModel, LabelSelector
from .pool import PolyKVPoolSpec, PolyKVPoolStatus, PoolCapacity, PoolMessage, PoolReplica
from .resources import ADMISSION, ENGINE, KINDS, POOL, Kind

__all__ = [
    "ADMISSION",
    "API_VERSION",
    "CATEGORY",
    "ENGINE",
    "GROUP",
    "KINDS",
    "POOL",
    "VERSION",
    "AdmissionPolicySpec",
    "AdmissionPolicyStatus",
    "Condition",
    "Kind",
    "KubeModel",
    "LabelSelector",
    "ModelInit",
    "ModelSource",
    "PolicyConflict",
    "PolyKVEngineSpec",
    "PolyKVEngineStatus",
    "PolyKVPoolSpec",
    "PolyKVPoolStatus",
    "PoolCapacity",
    "PoolMessage",
    "PoolReplica",
    "ReplicaStatus",
    "RouterSpec",
    "SnapshotSpec",
    "SnapshotTotals",
]
