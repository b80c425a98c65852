"""Which AdmissionPolicy applies to which pool, and what the engine is told.

A pool selected by exactly one policy gets it. A pool selected by two or more gets none of
them and every one of those policies reports the conflict: picking a winner silently would
hide a configuration mistake that changes who gets admitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from polykv_api import models as wire

from .api import AdmissionPolicySpec, LabelSelector


@dataclass(frozen=True)
class PolicyNode:
    """An AdmissionPolicy as the operator indexes it."""

    namespace: str
    name: str
    uid: str
    spec: AdmissionPolicySpec
    generation: int = 1


@dataclass(frozen=True)
class Selection:
    """The outcome for one namespace."""

    applied: dict[str, PolicyNode] = field(default_factory=dict)  # pool -> its policy
    conflicts: dict[str, list[str]] = field(default_factory=dict)  # pool -> policy names
    selected: dict[str, list[str]] = field(default_factory=dict)  # policy -> pool names


def matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    for key, value in (selector.match_labels or {}).items():
        if labels.get(key) != value:
            return False
    for req in selector.match_expressions or []:
        values = set(req.values or [])
        present = req.key in labels
        if req.operator == "In" and not (present and labels[req.key] in values):
            return False
        if req.operator == "NotIn" and present and labels[req.key] in values:
            return False
        if req.operator == "Exists" and not present:
            return False
        if req.operator == "DoesNotExist" and present:
            return False
    return True


def selects(policy: PolicyNode, pool: str, labels: Mapping[str, str]) -> bool:
    if policy.spec.pool_refs is not None:
        return any(ref.name == pool for ref in policy.spec.pool_refs)
    if policy.spec.pool_selector is not None:
        return matches(policy.spec.pool_selector, labels)
    return False


def select(policies: Iterable[PolicyNode], pools: Mapping[str, Mapping[str, str]]) -> Selection:
    """`pools`: pool name -> its labels (one namespace)."""
    chosen = sorted(policies, key=lambda p: p.name)
    out = Selection()
    for policy in chosen:
        out.selected[policy.name] = sorted(
            name for name, labels in pools.items() if selects(policy, name, labels)
        )
    for pool in sorted(pools):
        hits = [p for p in chosen if pool in out.selected[p.name]]
        if len(hits) == 1:
            out.applied[pool] = hits[0]
        elif len(hits) > 1:
            out.conflicts[pool] = [p.name for p in hits]
    return out


def engine_policy(spec: AdmissionPolicySpec) -> wire.AdmissionPolicy:
    """The body of POST /polykv/pools/{pool}/admission."""
    return wire.AdmissionPolicy(
        target_tps_per_session=spec.target_tps_per_session,
        mode=spec.mode,
        on_saturation=spec.on_saturation,
        guarantee_min_sessions=spec.guarantee_min_sessions,
        settle_tokens=spec.settle_tokens,
        settle_max_ms=spec.settle_max_ms,
        queue_max_ms=spec.queue_max_ms,
    )


def same_policy(a: wire.AdmissionPolicy | None, b: wire.AdmissionPolicy | None) -> bool:
    """Equal on the contract's fields (an engine may echo fields it added)."""
    if a is None or b is None:
        return a is b
    keys = set(wire.AdmissionPolicy.model_fields)
    return a.model_dump(include=keys) == b.model_dump(include=keys)
