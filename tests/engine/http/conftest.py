"""Engine fixtures: real polykv-engine processes on the generated test model."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from polykv_engine.testing import EngineProcess, engine_starter

# f32 KV keeps batched and solo logits within ~1e-6, so greedy outputs compare exactly. Flash
# attention is off here because ggml's CPU kernel picks its reduction by batch shape (KV split
# across threads for a lone decode token over 512+ cells, tiles for wide batches): the same
# token then rounds differently alone and batched, and a near-tie can flip hundreds of tokens
# in. test_flash_attention.py checks the default kernel against this one.
DETERMINISTIC = ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]


@pytest.fixture(scope="session")
def start_engine(
    test_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., EngineProcess]]:
    """Start an engine with extra CLI args; every engine started is stopped at session end."""
    with engine_starter(tmp_path_factory.mktemp("engine-logs")) as start:
        yield functools.partial(start, test_model)


@pytest.fixture(scope="module")
def start_on(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., EngineProcess]]:
    """Start an engine on another model file; each one is stopped at the module's end."""
    with engine_starter(tmp_path_factory.mktemp("engines-on")) as start:
        yield start


@pytest.fixture(scope="session")
def engine(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    """The shared engine: 4 slots, unified 8k cache, metrics on, no key."""
    return start_engine("-np", "4", "-c", "8192", "--metrics", *DETERMINISTIC)


@pytest.fixture
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.base_url, timeout=60.0) as c:
        yield c


def greedy(prompt: str | list[int], n: int = 24, **extra: object) -> dict[str, object]:
    return {"prompt": prompt, "n_predict": n, "temperature": 0, **extra}
