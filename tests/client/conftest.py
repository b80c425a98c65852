"""A real engine on the generated test model (tiny: starts and decodes in well under a
second) for the client's tests, with an API key and an admin key so refusals of both kinds
can be provoked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from polykv_client import PolyKVClient
from polykv_engine.testing import EngineProcess

ADMIN_KEY = "admin-key"
API_KEY = "infer-key"
MAX_POOLS = 4


@pytest.fixture(scope="module")
def engine(test_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    eng = EngineProcess(
        test_model,
        (
            "-np",
            "2",
            "-c",
            "2048",
            "--polykv-max-pools",
            str(MAX_POOLS),
            "--api-key",
            API_KEY,
            "--polykv-admin-key",
            ADMIN_KEY,
            "--metrics",  # the engine's own request counts show what reached it
        ),
        log_path=tmp_path_factory.mktemp("client-engine") / "engine.log",
    )
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture
def admin(engine: EngineProcess) -> Iterator[PolyKVClient]:
    """A client holding both keys, on an engine with no pools left from another test."""
    with PolyKVClient(engine.base_url, api_key=API_KEY, admin_key=ADMIN_KEY) as c:
        for pool in sorted(c.list_pools().pools, key=lambda p: -p.depth):
            c.release(pool.pool_id)
        yield c
