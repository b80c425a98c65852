"""Every PolyKVPool field is bounded by the CRD (generated from api/pool.py), and the real
API server refuses a pool past a bound with the field and the bound named: an over-long
prefix never reaches an operator, let alone an engine's event loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polykv_operator.api import pool as bounds
from polykv_testenv import ApiError, ControlPlane

from ..helpers import Obj
from .test_operator import obj_path, pool_manifest

pytestmark = pytest.mark.k8s

MSG = {"role": "system", "content": "x"}
TOOL = {"type": "function", "function": {"name": "f"}}


def over(field: str) -> tuple[Obj, str, int]:
    """A spec one past `field`'s bound, the path the API server names, and the bound."""
    n = bounds.MAX_PREFIX_CHARS
    cases: dict[str, tuple[dict[str, Any], str, int]] = {
        "text": ({"text": "a" * (n + 1)}, "spec.text", n),
        "appendText": ({"parent": "p", "appendText": "a" * (n + 1)}, "spec.appendText", n),
        "content": (
            {"messages": [{"role": "system", "content": "a" * (n + 1)}]},
            "spec.messages[0].content",
            n,
        ),
        "messages": (
            {"messages": [MSG] * (bounds.MAX_POOL_MESSAGES + 1)},
            "spec.messages",
            bounds.MAX_POOL_MESSAGES,
        ),
        "appendMessages": (
            {"parent": "p", "appendMessages": [MSG] * (bounds.MAX_POOL_MESSAGES + 1)},
            "spec.appendMessages",
            bounds.MAX_POOL_MESSAGES,
        ),
        "tools": (
            {"messages": [MSG], "tools": [TOOL] * (bounds.MAX_POOL_TOOLS + 1)},
            "spec.tools",
            bounds.MAX_POOL_TOOLS,
        ),
        "tokens": (
            {"tokens": [1] * (bounds.MAX_POOL_TOKENS + 1)},
            "spec.tokens",
            bounds.MAX_POOL_TOKENS,
        ),
        "name": (
            {"messages": [{**MSG, "name": "n" * (bounds.MAX_NAME_CHARS + 1)}]},
            "spec.messages[0].name",
            bounds.MAX_NAME_CHARS,
        ),
    }
    spec, path, limit = cases[field]
    return pool_manifest(f"over-{field.lower()}", **spec), path, limit


FIELDS = ("text", "appendText", "content", "messages", "appendMessages", "tools", "tokens", "name")


def test_a_pool_past_any_bound_is_refused_naming_the_field_and_the_bound(
    k8s_cluster: ControlPlane, namespace: str, operator_kubeconfig: Path
) -> None:
    """operator_kubeconfig installs the CRDs; no operator needs to run."""
    for field in FIELDS:
        manifest, path, limit = over(field)
        with pytest.raises(ApiError) as refused:
            k8s_cluster.api.create(obj_path(namespace, "polykvpools"), manifest)
        err = refused.value
        assert err.status == 422, (field, err)
        assert path in err.message and str(limit) in err.message, (field, err.message[:400])
        print(f"{field}: {err.message[:160]}")
    # At the bound itself, the same pool is accepted.
    at = pool_manifest("at-bound", text="a" * bounds.MAX_PREFIX_CHARS)
    k8s_cluster.api.create(obj_path(namespace, "polykvpools"), at)
