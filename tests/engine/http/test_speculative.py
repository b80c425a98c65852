"""Speculative decoding through HTTP: the same greedy text with and without it, alone and
batched, attached to a pool (whose cells drafts never touch), with its acceptance reported
in timings, /slots, /polykv/tps and /metrics; out-of-bound settings refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess, EngineStartError

from .conftest import DETERMINISTIC
from .pool_helpers import ADMIN, check_accounting, create, release_all, tokenize
from .test_parking import metric

# Text that repeats itself, as a code edit or a quoting summary does: the tiny model's
# greedy continuation of it repeats too, so drafts from the context get accepted.
REPEATING = "def add(a, b):\n    return a + b\n\n" * 6
PROMPTS = [
    REPEATING,
    "The list: red, green, blue; red, green, blue; red, green,",
    "Once upon a time there was a kernel that scheduled " * 5,
    "A",
]


@pytest.fixture(scope="module")
def spec_engine(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    return start_engine(
        "-np", "4", "-c", "8192", "--metrics", "--polykv-kv-debug",
        "--polykv-admin-key", "admin-key", *DETERMINISTIC,
    )  # fmt: skip


@pytest.fixture
def sc(spec_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=spec_engine.base_url, timeout=120, headers=ADMIN) as c:
        release_all(c)
        yield c
        release_all(c)


def complete(c: httpx.Client, prompt: Any, spec: str, n: int = 96, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False,
            "speculative.type": spec, **extra}  # fmt: skip
    r = c.post("/completion", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_greedy_text_is_the_same_and_drafts_are_kept(sc: httpx.Client) -> None:
    plain = complete(sc, REPEATING, "none")
    drafted0 = metric(sc, "polykv_spec_draft_tokens_total")
    accepted0 = metric(sc, "polykv_spec_accepted_tokens_total")
    calls0 = metric(sc, "polykv_decode_calls_total")
    spec = complete(sc, REPEATING, "ngram", **{"speculative.n_max": 8})
    calls = metric(sc, "polykv_decode_calls_total") - calls0
    assert spec["content"] == plain["content"] and spec["tokens"] == plain["tokens"]
    assert "draft_n" not in plain["timings"]
    t = spec["timings"]
    assert t["predicted_n"] == plain["timings"]["predicted_n"] == 96
    assert 0 < t["draft_n_accepted"] <= t["draft_n"], t
    assert metric(sc, "polykv_spec_draft_tokens_total") - drafted0 == t["draft_n"]
    assert metric(sc, "polykv_spec_accepted_tokens_total") - accepted0 == t["draft_n_accepted"]
    slot = next(s for s in sc.get("/slots").json() if s["id"] == spec["id_slot"])
    assert slot["speculative"] is True
    assert (slot["draft_n"], slot["draft_n_accepted"]) == (t["draft_n"], t["draft_n_accepted"])
    # Every kept draft token is a step saved: one call for the prompt, then one per step.
    assert calls <= 1 + 96 - t["draft_n_accepted"], calls
    check_accounting(sc)


def test_batched_sessions_speculating_match_their_solo_runs(sc: httpx.Client) -> None:
    solo = [complete(sc, p, "none", 48)["content"] for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: complete(sc, p, "ngram", 48)["content"], PROMPTS))
    assert batched == solo
    check_accounting(sc)


def test_a_pooled_session_speculates_without_touching_the_pool(sc: httpx.Client) -> None:
    prefix = tokenize(sc, REPEATING)
    create(sc, tokens=prefix, name="spec-pool")
    suffix = tokenize(sc, "def sub(a, b):\n    return a - b\n\n", add_special=False)
    body = {"pool_id": "spec-pool", "session_id": "spec-a"}
    spec = complete(sc, prefix + suffix, "ngram", **body)
    assert spec["timings"]["draft_n_accepted"] > 0
    assert spec["timings"]["cache_n"] >= len(prefix)
    check_accounting(sc)  # the shadow of every cell equals llama.cpp's own count
    # The pool's cells are as they were: a session attaching now reads the same prefix.
    plain = complete(sc, prefix + suffix, "none", pool_id="spec-pool", session_id="spec-b")
    assert plain["content"] == spec["content"]
    unpooled = complete(sc, prefix + suffix, "none")
    assert unpooled["content"] == spec["content"]
    tps = sc.get("/polykv/tps").json()
    a = next(s for s in tps["sessions"] if s["session_id"] == "spec-a")
    assert a["draft_n_accepted"] == spec["timings"]["draft_n_accepted"] > 0


def test_the_engine_default_applies_and_a_request_may_turn_it_off(
    start_engine: Callable[..., EngineProcess],
) -> None:
    eng = start_engine("-np", "1", "-c", "4096", "--spec-type", "ngram", *DETERMINISTIC)
    with httpx.Client(base_url=eng.base_url, timeout=120) as c:
        body = {"prompt": REPEATING, "n_predict": 64, "temperature": 0, "cache_prompt": False}
        on = c.post("/completion", json=body).json()
        off = c.post("/completion", json={**body, "speculative.type": "none"}).json()
    assert on["content"] == off["content"]
    assert on["timings"]["draft_n"] > 0 and "draft_n" not in off["timings"]


# Every route that takes the sampling fields, with the least body it accepts.
ROUTES = {
    "/completion": {"prompt": "x", "n_predict": 1},
    "/v1/completions": {"prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "x"}],
                     "max_tokens": 1},
    "/v1/responses": {"input": "x", "max_output_tokens": 1},
}  # fmt: skip
OUT_OF_BOUNDS = [
    ("speculative.n_max", 65),
    ("speculative.n_max", -1),
    ("speculative.n_max", 2.5),
    ("speculative.n_max", 2**31),
    ("speculative.n_min", -1),
    ("speculative.n_min", 65),
    ("speculative.type", "eagle3"),
    ("speculative.type", 1),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("field", "value"), OUT_OF_BOUNDS)
def test_out_of_bound_settings_are_refused_naming_the_field(
    sc: httpx.Client, route: str, field: str, value: object
) -> None:
    r = sc.post(route, json={**ROUTES[route], field: value})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ROUTES)
def test_settings_within_bounds_are_taken_on_every_route(sc: httpx.Client, route: str) -> None:
    body = {**ROUTES[route], "speculative.type": "ngram", "speculative.n_max": 64,
            "speculative.n_min": 0}  # fmt: skip
    r = sc.post(route, json=body)
    assert r.status_code == 200, r.text


def test_a_draft_model_drafts_and_the_text_is_the_same(
    start_engine: Callable[..., EngineProcess], test_model: Path
) -> None:
    # The model as its own draft: its guesses are what it would pick, nearly all kept.
    eng = start_engine(
        "-np", "2", "-c", "4096", "-md", str(test_model), "--polykv-kv-debug",
        "--polykv-admin-key", "admin-key", *DETERMINISTIC,
    )  # fmt: skip
    with httpx.Client(base_url=eng.base_url, timeout=120, headers=ADMIN) as c:
        with ThreadPoolExecutor(2) as pool:
            plain = list(pool.map(lambda p: complete(c, p, "none", 64), PROMPTS[:2]))
            drafted = list(pool.map(lambda p: complete(c, p, "draft", 64), PROMPTS[:2]))
        check_accounting(c)
    assert [d["content"] for d in drafted] == [p["content"] for p in plain]
    t = drafted[0]["timings"]
    assert t["draft_n"] > 0 and t["draft_n_accepted"] >= t["draft_n"] // 2, t


@pytest.mark.real_model
def test_a_draft_model_of_another_vocabulary_is_refused_at_boot(
    start_engine: Callable[..., EngineProcess], smollm2: Path
) -> None:
    with pytest.raises(EngineStartError, match="share the model's vocabulary"):
        start_engine("-np", "1", "-c", "1024", "-md", str(smollm2))


def test_a_draft_without_a_draft_model_is_refused(sc: httpx.Client) -> None:
    r = sc.post("/completion", json={"prompt": "x", "n_predict": 1, "speculative.type": "draft"})
    assert r.status_code == 400 and r.json()["error"]["reason"] == "not_supported", r.text
    assert "speculative.type" in r.json()["error"]["message"]
