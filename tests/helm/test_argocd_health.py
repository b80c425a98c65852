"""The chart's Argo CD health check, run in Lua 5.1 (Argo CD's dialect) on status objects
captured from the real operator by tests/e2e/polykv/test_health.py, plus the cases around
them: Ready=Unknown while a replica does not answer, Ready=False with no other condition."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from .health import EXPECTED, FIXTURES, SCRIPT, argocd_health

CAPTURED: dict[str, Any] = json.loads(FIXTURES.read_text())


@pytest.mark.parametrize("state", sorted(EXPECTED))
def test_captured_state(state: str) -> None:
    assert argocd_health(CAPTURED[state])[0] == EXPECTED[state][0]


def test_messages_say_what_is_going_on() -> None:
    assert "BranchPosOutOfRange: branchPos 100000" in argocd_health(CAPTURED["stalled-pool"])[1]
    deleting = argocd_health(CAPTURED["deleting-pool"])[1]
    assert deleting == "Being deleted, blocked by finalizers: polykv.io/finalizer"
    stale = argocd_health(CAPTURED["stale-generation-engine"])[1]
    assert "has not observed generation 2 yet (status is for 1)" in stale
    assert argocd_health(CAPTURED["reconciling-pool"])[1].startswith("NoReadyReplica")


def with_conditions(base: dict[str, Any], **statuses: str) -> dict[str, Any]:
    obj = copy.deepcopy(base)
    for c in obj["status"]["conditions"]:
        c["status"] = statuses.get(c["type"], "False")
    return obj


def test_ready_unknown_is_progressing_and_plain_not_ready_is_degraded() -> None:
    pool = CAPTURED["ready-pool"]
    assert argocd_health(with_conditions(pool, Ready="Unknown", Reconciling="True"))[0] == (
        "Progressing"
    )
    assert argocd_health(with_conditions(pool, Ready="Unknown"))[0] == "Progressing"
    assert argocd_health(with_conditions(pool))[0] == "Degraded"
    no_conditions = copy.deepcopy(pool)
    del no_conditions["status"]["conditions"]
    assert argocd_health(no_conditions) == ("Progressing", "No Ready condition yet")


def test_the_argocd_cm_snippet_carries_the_script_for_each_kind() -> None:
    cm = yaml.safe_load((SCRIPT.parents[2] / "docs" / "argocd-cm.yaml").read_text())
    keys = {
        f"resource.customizations.health.polykv.io_{k}"
        for k in ("PolyKVEngine", "PolyKVPool", "AdmissionPolicy")
    }
    assert set(cm["data"]) == keys
    assert all(v == SCRIPT.read_text() for v in cm["data"].values())
