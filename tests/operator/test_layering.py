"""The operator's layering (operator/README.md), checked on its imports as written.

Layers, bottom up: api <- pure <- I/O <- entry. A module imports from its own layer or
below; the imports between modules form no cycle; only the entry layer imports kopf.
A new module must be given a layer here, which is the point: someone decides where it goes.
The autoscale/ subpackage holds pure and I/O modules: each of its modules has a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ..layering import LayerRule, Package, cycles

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "polykv_operator"

LAYERS: dict[str, int] = {
    "api": 0,
    **dict.fromkeys(
        (
            "names",
            "fleet",
            "replicas",
            "tree",
            "policies",
            "gates",
            "conditions",
            "manifests",
            "network_policies",
            "status",
        ),
        1,
    ),
    **dict.fromkeys(
        (
            "autoscale.aggregate",
            "autoscale.deletion_cost",
            "autoscale.external_metrics",
            "autoscale.report",
            "autoscale.apiservice",
            "autoscale.serving_cert",
        ),
        1,
    ),
    **dict.fromkeys(
        (
            "config",
            "faults",
            "metrics",
            "engine_client",
            "kube",
            "engine_objects",
            "engine_round",
            "engine_loop",
            "pool_release",
        ),
        2,
    ),
    **dict.fromkeys(("autoscale.tls", "autoscale.metrics_api"), 2),
    **dict.fromkeys(("main", "cli", "crdgen", "hooks", "chartgen", "kubectl_plugin"), 3),
}
ENTRY = 3
NAMES = {0: "api", 1: "pure", 2: "I/O", 3: "entry"}


SPLIT = frozenset({"autoscale"})
OPERATOR = Package(PACKAGE, split=SPLIT)
RULE = LayerRule(LAYERS, NAMES)


def unit_of(path: Path) -> str:
    return OPERATOR.unit_of(path)


def imports(path: Path, package: Path = PACKAGE) -> tuple[set[str], set[str]]:
    return Package(package, OPERATOR.name, SPLIT).imports(path)


def graph() -> dict[str, set[str]]:
    return OPERATOR.graph()


def upward(g: dict[str, set[str]]) -> list[str]:
    return RULE.upward(g)


def test_every_module_has_a_layer() -> None:
    assert set(graph()) == set(LAYERS), "give the new module a layer in LAYERS (and a README line)"


def test_no_module_imports_upwards() -> None:
    assert upward(graph()) == []


def test_the_imports_form_no_cycle() -> None:
    assert cycles(graph()) == []


def test_only_the_entry_layer_imports_kopf() -> None:
    below = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if LAYERS.get(unit_of(p), ENTRY) < ENTRY and "kopf" in imports(p)[1]
    )
    assert below == []


def test_the_wire_contract_is_imported_as_a_module() -> None:
    """`from polykv_api import models as wire`: provenance visible at every use."""
    named = []
    for p in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "polykv_api.models":
                named.append(f"{p.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module == "polykv_api":
                assert [(a.name, a.asname) for a in node.names] == [("models", "wire")], p
    assert named == []


@pytest.mark.parametrize(
    ("source", "where", "expected"),
    [
        ("from . import gates, status as stat\n", "main.py", {"gates", "status"}),
        ("from .api import ENGINE\nfrom .api.meta import X\n", "status.py", {"api"}),
        ("from ..meta import X\nfrom . import pool\n", "api/engine.py", {"meta", "api"}),
        ("import polykv_operator.fleet\n", "gates.py", {"fleet"}),
        ("from .autoscale import report, tls\n", "main.py", {"autoscale.report", "autoscale.tls"}),
        ("from .autoscale.aggregate import Signal\n", "metrics.py", {"autoscale.aggregate"}),
        ("from ..fleet import Observation\n", "autoscale/aggregate.py", {"fleet"}),
        (
            "from . import report\nfrom .tls import X\n",
            "autoscale/metrics_api.py",
            {"autoscale.report", "autoscale.tls"},
        ),
    ],
)
def test_the_reader_resolves_relative_imports(
    tmp_path: Path, source: str, where: str, expected: set[str]
) -> None:
    path = tmp_path / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    assert imports(path, tmp_path)[0] == expected


def test_an_upward_import_and_a_cycle_would_be_caught() -> None:
    g = {"tree": {"engine_round"}, "engine_round": {"tree"}}
    assert upward(g) == ["tree (pure) imports engine_round (I/O)"]
    assert cycles(g) == ["engine_round -> tree -> engine_round"]


def test_every_crash_point_is_in_the_code() -> None:
    """The fault test walks faults.POINTS; a point no handler reaches would pass silently."""
    from polykv_operator.faults import POINTS

    src = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "faults.py")
    for point in POINTS:
        kind = point.removesuffix("-applied")
        assert f'"{point}"' in src or (point.endswith("-applied") and kind in src.lower()), point
