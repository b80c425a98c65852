"""Fixtures shared by every suite: the generated models (never downloaded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _model(preset: str, tmp_factory: pytest.TempPathFactory) -> Path:
    # `make models` builds these once; generate on the fly when pytest runs on its own.
    built = ROOT / "models" / f"polykv-{preset}.gguf"
    if built.is_file():
        return built
    out = tmp_factory.mktemp("models") / f"polykv-{preset}.gguf"
    subprocess.run(
        [sys.executable, "-m", "polykv_modelgen.cli", "--preset", preset, str(out)],
        check=True,
    )
    return out


@pytest.fixture(scope="session")
def test_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model("test", tmp_path_factory)


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~100M parameters: decodes at tens of tokens/s on a CPU, like a real deployment."""
    return _model("bench", tmp_path_factory)
