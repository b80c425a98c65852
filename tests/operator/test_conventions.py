"""Two conventions of the operator's sources that no import contract can say: the wire
contract is imported as a module, and every crash point the fault tests walk is reached."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "polykv_operator"


def test_the_wire_contract_is_imported_as_a_module() -> None:
    """`from polykv_api import models as wire`: provenance visible at every use."""
    named = []
    for p in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "polykv_api.models":
                named.append(f"{p.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module == "polykv_api":
                for a in node.names:  # other modules of polykv_api (tracing) as they are
                    assert a.name != "models" or a.asname == "wire", p
    assert named == []


def test_every_crash_point_is_in_the_code() -> None:
    """The fault test walks faults.POINTS; a point no handler reaches would pass silently."""
    from polykv_operator.faults import POINTS

    src = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "faults.py")
    for point in POINTS:
        kind = point.removesuffix("-applied")
        assert f'"{point}"' in src or (point.endswith("-applied") and kind in src.lower()), point
