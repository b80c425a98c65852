"""Schema-driven fuzzing of the three kinds: specs generated from the committed CRD schemas
(hypothesis-jsonschema), and arbitrary JSON, created through the API server with strict
field validation. Each is refused at admission (a 4xx, never a 5xx), or accepted and then
given conditions with a reason by the operator, which neither crashes nor fails a handler.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from polykv_testenv import ApiError, ControlPlane

from ..helpers import eventually, get_or_none
from .test_operator import Operator, obj_path

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

CRDS = Path(__file__).resolve().parents[3] / "crds"
KINDS = {
    "PolyKVPool": "polykvpools",
    "AdmissionPolicy": "admissionpolicies",
    "PolyKVEngine": "polykvengines",
}
# Engine fields that only shape its pods: random values there test the Deployment's
# validation, not ours (and no pods run: replicas is held at 0).
ENGINE_POD_FIELDS = ("image", "extraArgs", "resources", "podLabels", "apiKeySecretRef")
EXAMPLES = 15  # per kind and strategy


def spec_schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / f"{plural}.polykv.io.yaml").read_text())
    schema = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    spec: dict[str, Any] = schema["properties"]["spec"]
    close(spec)
    if plural == "polykvengines":
        for f in ENGINE_POD_FIELDS:
            spec["properties"].pop(f, None)
        spec["properties"]["replicas"]["maximum"] = 0
        model = spec["properties"]["model"]["properties"]
        for f in ("volume", "mountPath", "init"):
            model.pop(f, None)
    return spec


def close(schema: Any) -> None:
    """Structural schemas allow no unknown fields (pruned, or refused under strict field
    validation): generate objects without them; arbitrary JSON covers the rest."""
    if isinstance(schema, dict):
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        for v in schema.values():
            close(v)
    elif isinstance(schema, list):
        for v in schema:
            close(v)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def test_fuzzed_resources_are_refused_or_get_a_condition(
    k8s_cluster: ControlPlane, namespace: str, operator: Operator
) -> None:
    """Figure: 90 fuzzed resources (15 schema-valid and 15 arbitrary per kind): every one
    refused with a 4xx (0 5xx, 0 unknown fields kept) or given Ready/Reconciling/Stalled with
    a reason; the operator alive, 0 handler exceptions."""
    counter = itertools.count()
    outcomes: dict[str, list[tuple[str, int]]] = {"accepted": [], "refused": []}

    def submit(kind: str, spec: Any) -> None:
        plural = KINDS[kind]
        name = f"fz-{next(counter)}"
        body = {
            "apiVersion": "polykv.io/v1alpha1",
            "kind": kind,
            "metadata": {"name": name},
            "spec": spec,
        }
        path = obj_path(namespace, plural) + "?fieldValidation=Strict"
        try:
            k8s_cluster.api.create(path, body)
        except ApiError as exc:
            assert 400 <= exc.status < 500, (exc.status, body)
            outcomes["refused"].append((name, exc.status))
            return
        outcomes["accepted"].append((plural, int(name[3:])))

    run = settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )

    def submitter(kind: str) -> Callable[[Any], None]:
        # hypothesis refuses @given on a function with defaults (a lambda binding `kind`).
        def one(spec: Any) -> None:
            submit(kind, spec)

        return one

    for kind, plural in KINDS.items():
        run(given(from_schema(spec_schema(plural)))(submitter(kind)))()
        run(given(JSON)(submitter(kind)))()
    accepted = outcomes["accepted"]
    assert outcomes["refused"] and accepted, outcomes

    def conditioned(plural: str, n: int) -> bool | None:
        obj = get_or_none(k8s_cluster.api, obj_path(namespace, plural, f"fz-{n}"))
        conds = {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}
        if set(conds) != {"Ready", "Reconciling", "Stalled"}:
            return None
        return True if all(c.get("reason") for c in conds.values()) else None

    for plural, n in accepted:
        eventually(f"{plural}/fz-{n} has conditions", lambda p=plural, i=n: conditioned(p, i), 90)
    assert operator.alive()
    log = operator.log()
    assert "Traceback" not in log and "failed with an exception" not in log, log[-3000:]
    print(
        f"fuzz: {len(accepted)} accepted with conditions, {len(outcomes['refused'])} refused "
        f"({sorted({s for _, s in outcomes['refused']})})"
    )
    httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=10).raise_for_status()
