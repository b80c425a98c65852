"""AdmissionPolicy: a per-session tokens/s floor for the selected pools.

Not Kubernetes' ValidatingAdmissionPolicy: this one decides whether a new agent session may
attach to a PolyKVPool, on the engine, from measured decode speed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .meta import CONDITIONS_SCHEMA_EXTRA, Condition, KubeModel, LabelSelector, LocalObjectReference

SPEC_RULES: list[dict[str, str]] = [
    {
        "rule": "has(self.poolSelector) != has(self.poolRefs)",
        "message": "give exactly one of poolSelector or poolRefs",
    },
]


class AdmissionPolicySpec(KubeModel):
    """Which pools the policy covers, and the engine's admission settings for them."""

    pool_selector: LabelSelector | None = None
    """Selects PolyKVPools in this namespace by their labels."""
    pool_refs: list[LocalObjectReference] | None = Field(None, min_length=1)
    """Or names PolyKVPools in this namespace."""
    target_tps_per_session: float = Field(gt=0, allow_inf_nan=False)
    """The floor: mean experienced decode tokens/s a session should keep (any number above
    0; fractions such as 2.5 are fine)."""
    mode: Literal["advisory", "enforced"] = "advisory"
    """advisory reports capacity only; enforced gates new sessions on the engine."""
    on_saturation: Literal["reject", "warn", "queue"] = "reject"
    """What enforced mode does with a new session below the floor: 429 + Retry-After, admit
    with a warning header, or hold it until headroom returns."""
    guarantee_min_sessions: int = Field(1, ge=0)
    """Always admit up to this many sessions per pool and replica."""
    settle_tokens: int = Field(48, ge=1)
    """Tokens the last admitted session decodes before its effect counts as measured."""
    settle_max_ms: int = Field(5000, ge=1, le=600_000)
    """Longest the settle window lasts."""
    queue_max_ms: int = Field(30_000, ge=1, le=600_000)
    """Longest a queued session waits (onSaturation: queue)."""


class PolicyConflict(KubeModel):
    """A pool that more than one policy selects; none of them is applied to it."""

    pool: str
    """The PolyKVPool."""
    policies: list[str]
    """Every policy that selects it."""


class AdmissionPolicyStatus(KubeModel):
    """Where the policy is in effect."""

    observed_generation: int | None = None
    """The metadata.generation the status was computed from."""
    conditions: list[Condition] | None = Field(None, json_schema_extra=CONDITIONS_SCHEMA_EXTRA)
    """Ready, Reconciling and Stalled (kstatus); Stalled names conflicting policies."""
    selected_pools: list[str] | None = None
    """Pools the policy selects."""
    applied_pools: int | None = None
    """Selected pools that carry the policy on every replica."""
    conflicts: list[PolicyConflict] | None = None
    """Pools also selected by another policy: not applied until the selectors are disjoint."""
