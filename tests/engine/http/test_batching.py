"""Continuous batching must be invisible: a request returns the same text batched or alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from polykv_engine.testing import EngineProcess

from .conftest import greedy

PROMPTS = [
    "The quick brown fox",
    "In a distant galaxy, the engineers of the fleet decided that every ship",
    "def fibonacci(n):\n    ",
    "Once upon a time there was a kernel that scheduled " * 6,
    "Shared prefixes make multi-agent serving cheap because",
    "A",
]


def complete(base_url: str, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(f"{base_url}/completion", json=body, timeout=120.0)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


def test_concurrent_greedy_requests_match_solo_runs(engine: EngineProcess) -> None:
    # cache_prompt off so each solo run prefills from scratch, like the batched one.
    bodies = [greedy(p, n=32, cache_prompt=False) for p in PROMPTS]
    solo = [complete(engine.base_url, b)["content"] for b in bodies]
    # 6 requests on 4 slots: two of them must queue, and still come out identical.
    with ThreadPoolExecutor(len(bodies)) as pool:
        batched = list(pool.map(lambda b: complete(engine.base_url, b)["content"], bodies))
    assert batched == solo
    assert all(isinstance(s, str) and s for s in solo)


def test_prompts_joining_mid_flight_match_solo_runs(engine: EngineProcess) -> None:
    long_body = greedy("Long running generation: ", n=400, cache_prompt=False)
    short_bodies = [greedy(p, n=20, cache_prompt=False) for p in PROMPTS[:3]]
    solo_long = complete(engine.base_url, long_body)["content"]
    solo_short = [complete(engine.base_url, b)["content"] for b in short_bodies]

    results: dict[str, object] = {}

    def run_long() -> None:
        results["long"] = complete(engine.base_url, long_body)["content"]

    t = threading.Thread(target=run_long)
    t.start()
    # Wait until the long request is decoding, then send prompts that must join its batches.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        slots = httpx.get(f"{engine.base_url}/slots").json()
        if any(s["state"] == "decoding" for s in slots):
            break
        time.sleep(0.005)
    with ThreadPoolExecutor(3) as pool:
        joined = list(pool.map(lambda b: complete(engine.base_url, b)["content"], short_bodies))
    t.join()
    assert joined == solo_short
    assert results["long"] == solo_long


def test_requests_beyond_parallel_queue_and_all_complete(engine: EngineProcess) -> None:
    bodies = [greedy(f"request number {i}: ", n=8) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda b: complete(engine.base_url, b), bodies))
    assert len(outs) == 12
    assert all(o["stop"] is True and o["tokens_predicted"] == 8 for o in outs)
