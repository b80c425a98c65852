"""One real engine on SmolLM2-135M-Instruct for the LangGraph tests (the model `make models`
fetches), and a pool client that leaves no pool behind between tests."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from polykv_client import PolyKVClient
from polykv_engine.testing import EngineProcess, engine_starter


@pytest.fixture(scope="session")
def start_smol(
    smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., EngineProcess]]:
    with engine_starter(tmp_path_factory.mktemp("langgraph-engines"), timeout=180) as start:
        yield functools.partial(start, smollm2)


@pytest.fixture(scope="session")
def smol(start_smol: Callable[..., EngineProcess]) -> EngineProcess:
    """SmolLM2 with 4 slots and an 8k unified cache (the engine's documented setup)."""
    return start_smol("-np", "4", "-c", "8192", "--metrics")  # tests count what it received


def clean(c: PolyKVClient) -> None:
    """Release every pool (leaves first), so each test starts from an empty tree."""
    for pool in sorted(c.list_pools().pools, key=lambda p: -p.depth):
        c.release(pool.pool_id)


@pytest.fixture
def pools(smol: EngineProcess) -> Iterator[PolyKVClient]:
    with PolyKVClient(smol.base_url) as c:
        clean(c)
        yield c
        clean(c)
