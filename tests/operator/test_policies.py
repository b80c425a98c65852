"""Policy selection, conflicts and the engine's view of a policy."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from polykv_operator import crdgen
from polykv_operator.api import ADMISSION, AdmissionPolicySpec, LabelSelector
from polykv_operator.policies import engine_policy, matches, same_policy, select

from .builders import policy


def test_match_labels_and_expressions() -> None:
    sel = LabelSelector.model_validate(
        {
            "matchLabels": {"tier": "a"},
            "matchExpressions": [
                {"key": "team", "operator": "In", "values": ["x", "y"]},
                {"key": "legacy", "operator": "DoesNotExist"},
            ],
        }
    )
    assert matches(sel, {"tier": "a", "team": "x"})
    assert not matches(sel, {"tier": "a", "team": "z"})
    assert not matches(sel, {"tier": "a", "team": "x", "legacy": "1"})
    assert matches(LabelSelector(), {})


def test_one_policy_applies_two_conflict() -> None:
    pools = {"p1": {"tier": "a"}, "p2": {"tier": "b"}, "p3": {}}
    a = policy("a", poolSelector={"matchLabels": {"tier": "a"}})
    b = policy("b", poolRefs=[{"name": "p1"}, {"name": "p2"}])
    sel = select([b, a], pools)
    assert sel.conflicts == {"p1": ["a", "b"]}
    assert sel.applied["p2"].name == "b"
    assert "p1" not in sel.applied and "p3" not in sel.applied
    assert sel.selected == {"a": ["p1"], "b": ["p1", "p2"]}


def test_engine_policy_and_equality() -> None:
    p = policy("x", mode="enforced", onSaturation="queue", settleMaxMs=100)
    ep = engine_policy(p.spec)
    assert ep.target_tps_per_session == 5.0 and ep.on_saturation == "queue"
    assert ep.settle_max_ms == 100 and ep.guarantee_min_sessions == 1
    assert same_policy(ep, engine_policy(p.spec))
    assert not same_policy(ep, None) and same_policy(None, None)
    other = engine_policy(policy("y").spec)
    assert not same_policy(ep, other)


POLICY_SCHEMA = crdgen.crd(ADMISSION)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def crd_refuses(spec: dict[str, Any]) -> bool:
    """What the API server's schema check says (OpenAPI v3: boolean exclusive bounds, as in
    JSON Schema draft 4)."""
    body = {"spec": {"poolRefs": [{"name": "p"}], **spec}}
    return not jsonschema.Draft4Validator(POLICY_SCHEMA).is_valid(body)


@pytest.mark.parametrize("target", [2.5, 0.25, 1, 40])
def test_a_fractional_floor_is_accepted_and_pushed_as_given(target: float) -> None:
    assert not crd_refuses({"targetTpsPerSession": target})
    ep = engine_policy(policy("x", targetTpsPerSession=target).spec)
    assert ep.target_tps_per_session == target


@pytest.mark.parametrize("target", [0, 0.0, -1, -0.5, "fast", "2.5", True, None, [3]])
def test_a_floor_at_or_below_zero_or_not_a_number_is_refused(target: Any) -> None:
    assert crd_refuses({"targetTpsPerSession": target})
    with pytest.raises(ValidationError):
        AdmissionPolicySpec.model_validate(
            {"poolRefs": [{"name": "p"}], "targetTpsPerSession": target}, strict=True
        )


def test_the_floor_is_required() -> None:
    assert crd_refuses({})
