"""The default attention kernel (flash attention on a CPU) against the reference one.

ggml's CPU flash attention rounds differently by batch shape, so exact text equality is only
promised with ``-fa off`` (the DETERMINISTIC engines). What the default kernel must keep:
the same distribution as the reference kernel, and batching that never leaks one session into
another. Both are compared token by token, up to the first greedy near-tie that rounding may
flip, on logprobs rather than text.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from polykv_engine.testing import EngineProcess

from .conftest import greedy

F32_KV = ["-ctk", "f32", "-ctv", "f32"]
TOLERANCE = 3e-2  # logprob; wrong attention (a leaked or missing cell) moves it by far more


@pytest.fixture(scope="module")
def default_kernel(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    return start_engine("-np", "4", "-c", "8192", *F32_KV)


@pytest.fixture(scope="module")
def reference_kernel(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    return start_engine("-np", "4", "-c", "8192", *F32_KV, "-fa", "off")


def probs(base_url: str, body: dict[str, object]) -> list[dict[str, object]]:
    r = httpx.post(f"{base_url}/completion", json={**body, "n_probs": 2}, timeout=120.0)
    assert r.status_code == 200, r.text
    out: list[dict[str, object]] = r.json()["completion_probabilities"]
    return out


def agree(a: list[dict[str, object]], b: list[dict[str, object]]) -> int:
    """Compare two greedy runs position by position; returns how many positions were compared.

    Stops after the first position whose top two candidates lie within the tolerance of each
    other in either run: rounding may pick either, and the runs legitimately part there.
    """
    compared = 0
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"], (compared, x, y)
        assert x["logprob"] == pytest.approx(y["logprob"], abs=TOLERANCE), (compared, x, y)
        compared += 1
        if any(near_tie(p) for p in (x, y)):
            break
    return compared


def near_tie(p: dict[str, object]) -> bool:
    top = p["top_logprobs"]
    assert isinstance(top, list) and len(top) == 2
    return bool(top[0]["logprob"] - top[1]["logprob"] < 2 * TOLERANCE)


def long_prompt(base_url: str, tokens: int) -> str:
    """A prompt of at least ``tokens`` tokens: a lone decode step then attends over more than
    512 cells, where ggml splits the KV across threads."""
    text = "Long running generation over a shared context: "
    while True:
        r = httpx.post(f"{base_url}/tokenize", json={"content": text}, timeout=30.0)
        if len(r.json()["tokens"]) >= tokens:
            return text
        text += "the agents fork the pool and each one answers a different question. "


def test_default_kernel_matches_the_reference(
    default_kernel: EngineProcess, reference_kernel: EngineProcess
) -> None:
    for prompt in ("The quick brown fox", long_prompt(default_kernel.base_url, 600)):
        body = greedy(prompt, n=24, cache_prompt=False)
        compared = agree(
            probs(default_kernel.base_url, body), probs(reference_kernel.base_url, body)
        )
        assert compared >= 1


def test_default_kernel_batched_matches_alone(default_kernel: EngineProcess) -> None:
    url = default_kernel.base_url
    bodies = [greedy(long_prompt(url, 600), n=64, cache_prompt=False)] + [
        greedy(p, n=64, cache_prompt=False)
        for p in ("In a distant galaxy", "def fibonacci(n):\n    ", "Shared prefixes are cheap")
    ]
    alone = [probs(url, b) for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        batched = list(pool.map(lambda b: probs(url, b), bodies))
    for a, b in zip(alone, batched, strict=True):
        assert agree(a, b) >= 1
