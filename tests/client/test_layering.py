"""The layering of the client packages, checked on their imports: ``polykv_client`` needs
only pydantic, httpx and the wire contract; ``polykv_langgraph`` sits on the client and
LangChain/LangGraph; neither imports the engine server (or the operator)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "polykv_client": {"polykv_api", "polykv_client", "pydantic", "httpx"},
    "polykv_langgraph": {
        "polykv_api", "polykv_client", "polykv_langgraph", "pydantic", "httpx", "openai",
        "langchain_core", "langchain_openai", "langgraph",
    },
}  # fmt: skip
WHERE = {"polykv_client": ROOT / "engine_image", "polykv_langgraph": ROOT / "integrations"}
STDLIB = {"__future__", "collections", "contextlib", "dataclasses", "functools", "json",
          "math", "re", "typing", "urllib", "uuid"}  # fmt: skip


def imported(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_stay_in_their_layer(package: str) -> None:
    files = sorted((WHERE[package] / package).rglob("*.py"))
    assert files
    found = {f.name: imported(f) - STDLIB - ALLOWED[package] for f in files}
    assert {k: v for k, v in found.items() if v} == {}
