"""The layering of every package, as the import-linter contracts in pyproject.toml say it
(``[tool.importlinter]``): ``lint-imports`` keeps each one. A copy of the sources with one
forbidden import breaks the matching contract, so the check is shown to be able to fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
SOURCES = ("engine_image", "operator", "router", "integrations")


def lint(cwd: Path, path: list[Path] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "500"}  # one line per contract in the report
    if path is not None:  # ahead of the installed (editable) packages
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    return subprocess.run(
        [str(LINT), "--no-cache", "--no-logo"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_contract_is_kept() -> None:
    found = lint(ROOT)
    assert found.returncode == 0, found.stdout + found.stderr
    assert " 0 broken" in found.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packages and pyproject.toml, copied once (each case edits and restores one file)."""
    root = tmp_path_factory.mktemp("tree")
    for d in SOURCES:
        shutil.copytree(ROOT / d, root / d, ignore=shutil.ignore_patterns("__pycache__", "build"))
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        (
            "engine_image/polykv_engine/kv/cache.py",
            "from polykv_engine.core import engine",
            "Engine:",
        ),
        (
            "engine_image/polykv_engine/core/slots.py",
            "import llama_cpp",
            "Only polykv_engine.llama",
        ),
        ("engine_image/polykv_engine/cli.py", "import gguf", "Only the model generator"),
        (
            "engine_image/polykv_engine/kv/cells.py",
            "from polykv_engine.kv import cache",
            "No package",
        ),
        ("engine_image/polykv_api/models.py", "import polykv_client", "Packages:"),
        ("operator/polykv_operator/tree.py", "from . import engine_round", "Operator:"),
        ("operator/polykv_operator/engine_round.py", "import kopf", "Only the operator's entry"),
        (
            "operator/polykv_operator/status.py",
            "import polykv_engine",
            "reach the engine over HTTP",
        ),
        ("router/polykv_router/picker.py", "import asyncio", "The router's pure layer"),
        ("engine_image/polykv_client/ops.py", "import langgraph", "The client needs only"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    copy: Path, module: str, line: str, contract: str
) -> None:
    target = copy / module
    before = target.read_text()
    target.write_text(f"{before}\n{line}  # noqa\n")
    try:
        found = lint(copy, [copy / d for d in SOURCES])
    finally:
        target.write_text(before)
    assert found.returncode != 0, found.stdout
    broken = [ln for ln in found.stdout.splitlines() if ln.endswith(" BROKEN")]
    assert len(broken) >= 1 and any(contract in ln for ln in broken), found.stdout
