"""Automatic prefix sharing: traffic that names no pool still shares a common prefix with
whatever sequence already holds it (another session's cache, a running prompt), zero copy,
with the same greedy output as computing it again."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from polykv_engine.testing import EngineProcess

from .conftest import DETERMINISTIC

PREFIX = " ".join(f"rule {i}: be precise and cite the source." for i in range(40))


def ask(c: httpx.Client, suffix: str, session: str, n: int = 8) -> dict[str, Any]:
    body = {"prompt": PREFIX + suffix, "n_predict": n, "temperature": 0, "session_id": session}
    r = c.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_second_session_shares_the_first_ones_prefix(
    start_engine: Callable[..., EngineProcess],
) -> None:
    shared = start_engine("-np", "4", "-c", "8192", "--polykv-kv-debug", *DETERMINISTIC)
    plain = start_engine("-np", "4", "-c", "8192", "--no-polykv-auto-share", *DETERMINISTIC)
    with (
        httpx.Client(base_url=shared.base_url, timeout=120) as c,
        httpx.Client(base_url=plain.base_url, timeout=120) as p,
    ):
        first = ask(c, " Question A?", "s-a")
        n_prefix = len(c.post("/tokenize", json={"content": PREFIX}).json()["tokens"])
        second = ask(c, " Question B?", "s-b")
        assert first["timings"]["cache_n"] == 0
        assert second["timings"]["cache_n"] >= n_prefix - 2  # shared from s-a's cache
        # The same greedy text as computing everything again, on an engine that never shares.
        assert second["tokens"] == ask(p, " Question B?", "s-b")["tokens"]
        listing = c.get("/polykv/pools").json()
        assert listing["implicit_shared_cells"] >= n_prefix - 2
        sessions = {s["session_id"]: s for s in listing["unpooled_sessions"]}
        assert sessions["s-b"]["implicit_shared_tokens"] >= n_prefix - 2
        # Ownership still partitions the cells, and llama.cpp agrees on the count.
        owned = sum(s["marginal_kv_bytes"] for s in listing["unpooled_sessions"])
        assert owned == listing["kv_bytes_used"]
        assert listing["kv_cells_measured"] == listing["kv_cells_used"]
        assert p.get("/polykv/pools").json()["implicit_shared_cells"] == 0


def test_agents_released_together_compute_the_common_prefix_once(
    start_engine: Callable[..., EngineProcess],
) -> None:
    eng = start_engine("-np", "4", "-c", "8192", "--polykv-kv-debug", *DETERMINISTIC)
    with httpx.Client(base_url=eng.base_url, timeout=120) as c:
        n_prefix = len(c.post("/tokenize", json={"content": PREFIX}).json()["tokens"])
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: ask(c, f" Agent {i} asks?", f"agent-{i}"), range(4)))
        cached = sorted(r["timings"]["cache_n"] for r in results)
        assert cached[0] == 0 and all(n >= n_prefix - 2 for n in cached[1:]), cached
        listing = c.get("/polykv/pools").json()
        # One copy of the prefix, not four.
        assert listing["kv_cells_used"] < 2 * n_prefix
        assert listing["kv_cells_measured"] == listing["kv_cells_used"]
        prefilled = sum(r["timings"]["prompt_n"] for r in results)
        assert prefilled < 2 * n_prefix


def test_cache_prompt_false_opts_out(client: httpx.Client) -> None:
    ask(client, " one", "opt-a")
    body = {"prompt": PREFIX + " two", "n_predict": 2, "cache_prompt": False, "session_id": "opt-b"}
    assert client.post("/completion", json=body).json()["timings"]["cache_n"] == 0


def test_a_split_cache_never_shares_and_never_breaks(
    start_engine: Callable[..., EngineProcess],
) -> None:
    # Each slot owns its cells on a split cache: agents released together on one prefix each
    # compute it (as llama-server does) instead of crashing the engine on a partial copy.
    eng = start_engine("-np", "4", "-c", "8192", "--no-kv-unified", "--polykv-max-pools", "0")
    with httpx.Client(base_url=eng.base_url, timeout=120) as c:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: ask(c, f" Agent {i} asks?", f"split-{i}"), range(4)))
        assert all(r["timings"]["cache_n"] == 0 for r in results)
        assert c.get("/health").status_code == 200
        again = ask(c, " Agent 0 asks?", "split-0")  # its own slot's cache still serves it
        assert again["timings"]["cache_n"] > 0
