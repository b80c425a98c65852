"""Prompt pacing through HTTP: a newcomer's prompt is spread over steps while another
session decodes, the output is the same as alone, and /capacity counts the promised prompt."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess

from .conftest import DETERMINISTIC
from .pool_helpers import ADMIN, complete, create, release_all, tokenize
from .test_admission import capacity, policy, wait_for
from .test_parking import metric

NEWCOMER = "A newcomer arrives with a long tool result to read: " + "line of output, " * 150


class Decoding:
    """One session decoding a long answer in the background (attached to ``pool``, if
    given); the block starts once it decodes, and its end closes the stream (a cancel)."""

    def __init__(self, c: httpx.Client, pool: str | None = None, prompt: Any = "Count: ") -> None:
        self.body: dict[str, Any] = {
            "prompt": prompt, "n_predict": 100_000, "temperature": 0, "ignore_eos": True,
            "stream": True, "session_id": "pacing-bg",
        }  # fmt: skip
        if pool is not None:
            self.body["pool_id"] = pool
        self.c, self.done = c, threading.Event()
        self.thread = threading.Thread(target=self._run, args=(str(c.base_url),))
        self.status = 0

    def _run(self, base: str) -> None:
        with (
            httpx.Client(base_url=base, timeout=300, headers=ADMIN) as c,
            c.stream("POST", "/completion", json=self.body) as r,
        ):
            self.status = r.status_code
            for _ in r.iter_lines():
                if self.done.is_set():
                    return

    def __enter__(self) -> Decoding:
        self.thread.start()

        def decoding() -> bool:
            slots = self.c.get("/slots", headers=ADMIN).json()
            return any(s["state"] == "decoding" for s in slots)

        wait_for(decoding, what="a session decodes")
        # Its decode-only steps timed (what pacing and admission read), beside nothing else.
        step_curve = 'polykv_decode_step_seconds{batch="1"}'
        wait_for(lambda: step_curve in self.c.get("/metrics").text, what="step time measured")
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        assert self.status == 200, self.status


def newcomer(c: httpx.Client, repeat: int = 1) -> str:
    r = complete(c, NEWCOMER * repeat, 24, cache_prompt=False)
    assert r.status_code == 200, r.text
    content: str = r.json()["content"]
    return content


@pytest.fixture(scope="module")
def fixed(start_engine: Callable[..., EngineProcess]) -> Iterator[httpx.Client]:
    eng = start_engine(
        "-np", "2", "-c", "8192", "--metrics", "--polykv-prefill-budget", "8", *DETERMINISTIC,
    )  # fmt: skip
    with httpx.Client(base_url=eng.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def floored(start_engine: Callable[..., EngineProcess]) -> Iterator[httpx.Client]:
    eng = start_engine(
        "-np", "2", "-c", "8192", "--metrics", "--polykv-admin-key", "admin-key",
        *DETERMINISTIC,
    )  # fmt: skip
    with httpx.Client(base_url=eng.base_url, timeout=120, headers=ADMIN) as c:
        release_all(c)
        yield c
        release_all(c)


def test_a_fixed_budget_spreads_the_prompt_and_keeps_the_greedy_output(
    fixed: httpx.Client,
) -> None:
    alone = newcomer(fixed)
    paced_before = metric(fixed, "polykv_prefill_paced_steps_total")
    with Decoding(fixed):
        beside = newcomer(fixed)
    assert beside == alone
    n_prompt = len(tokenize(fixed, NEWCOMER))
    # 8 tokens a step: every step but the last was cut to the budget.
    paced = metric(fixed, "polykv_prefill_paced_steps_total") - paced_before
    assert paced >= n_prompt // 8 - 1, (paced, n_prompt)


def test_a_pool_floor_paces_the_prompt_and_capacity_counts_it(floored: httpx.Client) -> None:
    alone = newcomer(floored, 3)  # ~1,800 tokens: over a hundred paced steps
    prefix = tokenize(floored, "The shared instructions of the crew. " * 4)
    create(floored, tokens=prefix, name="paced")
    # A floor no session of the tiny model can reach: each step's prompt chunk gets as long
    # as the decode step takes (at least 16 tokens), so the prompt spreads over many steps.
    policy(
        floored, "paced", target_tps_per_session=1e9, mode="advisory",
        settle_tokens=1, settle_max_ms=1,
    )  # fmt: skip
    paced_before = metric(floored, "polykv_prefill_paced_steps_total")
    seen: list[dict[str, Any]] = []
    with Decoding(floored, pool="paced", prompt=[*prefix, 500]):
        out: list[str] = []
        arrival = threading.Thread(target=lambda: out.append(newcomer(floored, 3)))
        arrival.start()

        def promised() -> bool:
            cap = capacity(floored, "paced")
            seen.append(cap)
            return cap["prefill_pending_tokens"] > 0 or not arrival.is_alive()

        wait_for(promised, what="the newcomer's prompt counted by /capacity")
        arrival.join()
    assert out == [alone]
    assert metric(floored, "polykv_prefill_paced_steps_total") > paced_before
    during = [cap for cap in seen if cap["prefill_pending_tokens"] > 0]
    assert during, "the prompt went in before /capacity was read: no promised work seen"
    cap = during[0]
    # Under that floor the promised prompt would hold a new session, and says so.
    assert cap["reason_code"] == "prefill" and not cap["can_admit"], cap
    assert 0 < cap["projected_prefill_tps"] < 1e9, cap
