"""The router's reads of a real engine replica (``Engines``), parsed with the wire contract."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import httpx

from polykv_engine.testing import EngineProcess
from polykv_router.engines import Engines
from polykv_router.picker import PoolCapacity
from polykv_router.pods import Pod
from polykv_testenv.waiting import wait_for

from .helpers import create_pool, pool_prefix


async def _capacity(pod: Pod, pool: str) -> PoolCapacity | None:
    async with aiohttp.ClientSession() as http:
        return await Engines(http, None, timeout_s=30).capacity(pod, pool)


def test_an_idle_replicas_estimate_is_not_taken_for_a_projection(
    test_model: Path, tmp_path: Path
) -> None:
    """Between turns the engine projects from its memory of the last load (its gate needs a
    figure); the router ranks that replica as one without a projection, by its counts."""
    eng = EngineProcess(model=test_model, args=("-np", "2", "-c", "2048", "-t", "1"),
                        log_path=tmp_path / "engine.log")  # fmt: skip
    eng.start(timeout=120)
    try:
        c = httpx.Client(base_url=eng.base_url, timeout=120)
        create_pool(c, "p")
        body = {"prompt": pool_prefix("p") + " Go.", "pool_id": "p", "n_predict": 48}
        raw: dict[str, object] = {}

        def between_turns_with_an_estimate() -> bool | None:
            r = c.post("/completion", json=body, headers={"x-session-id": "s"})
            assert r.status_code == 200, r.text
            raw.update(c.get("/polykv/pools/p/capacity").json())
            return True if raw["projected_idle_estimate"] else None

        wait_for("an idle estimate", between_turns_with_an_estimate, timeout_s=120)
        assert isinstance(raw["projected_mean_tps_if_admitted"], float)
        host, port = eng.base_url.removeprefix("http://").split(":")
        pod = Pod("a", "uid-a", host, int(port), ready=True, terminating=False)
        seen = asyncio.run(_capacity(pod, "p"))
        assert seen is not None and seen.can_admit and seen.n_sessions == 1
        assert seen.projected_tps is None
        assert asyncio.run(_capacity(pod, "missing")) is None  # 404 pool_not_found
    finally:
        eng.stop()
