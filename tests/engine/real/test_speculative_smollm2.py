"""Speculative decoding on a real model pair through HTTP: SmolLM2 Q8_0 verifies what the
same network quantized to Q4_1 drafts (one vocabulary, weights that disagree now and then).
Greedy tokens with n-gram drafts and with the draft model, alone, streamed and batched, are
those without speculation up to a tie: verifying a draft computes its tokens as one batch,
and the quantized CPU kernels round a batch slightly differently than a single token (the
same numbers a prompt of those tokens gets), so where the model's top two choices are
within TIE the batch's pick may win. What was drafted and kept is reported per response,
per slot, per session and in the polykv_ metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess
from tests.conftest import real_model_path

from ..http.conftest import DETERMINISTIC
from ..http.pool_helpers import ADMIN, check_accounting
from ..http.test_parking import metric

pytestmark = pytest.mark.real_model

ARGS = (
    '{"path": "src/polykv/engine.py", "old": "def step(self):", "new": "def step(self) -> None:"}'
)
PROMPTS = [
    # A tool call that echoes arguments from the context, as agents' do.
    f"Tool result: {ARGS}\nThe same edit as a JSON tool call, repeated three times:\n{ARGS}\n",
    # Plain prose, which repeats little.
    "The history of the printing press begins in the fifteenth century, when",
]
N = 32
TIE = 0.2  # logprob: batch-vs-token rounding moved them by < 0.2 on this model


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    draft = real_model_path("smollm2-135m-instruct-q4_1")
    args = ["-np", "3", "-c", "6144", "-md", str(draft), "--metrics", "--polykv-kv-debug",
            "--polykv-admin-key", "admin-key", *DETERMINISTIC]  # fmt: skip
    eng = EngineProcess(
        real_model_path("smollm2-135m-instruct-q8_0"),
        args,
        log_path=tmp_path_factory.mktemp("spec-pair") / "engine.log",
        # Idle OpenMP threads sleep: on a shared, loaded CPU spinning ones made this 15x slower.
        env={"POLYKV_OMP_WAIT_POLICY": "passive"},
    )
    eng.start(timeout=300)
    try:
        with httpx.Client(base_url=eng.base_url, timeout=300, headers=ADMIN) as c:
            yield c
        assert "draft model loaded" in eng.log_tail(400)
    finally:
        assert eng.stop() == 0


def complete(c: httpx.Client, prompt: str, spec: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": N, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False, "speculative.type": spec, "n_probs": 2, **extra}  # fmt: skip
    r = c.post("/completion", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def assert_same_greedy(plain: dict[str, Any], tokens: list[int]) -> None:
    """``tokens`` are the plain run's, or leave them only at a tie of its top two."""
    assert len(tokens) == len(plain["tokens"]) == N
    i = next(
        (k for k, (a, b) in enumerate(zip(plain["tokens"], tokens, strict=True)) if a != b), None
    )
    if i is not None:
        top = plain["completion_probabilities"][i]["top_logprobs"]
        assert tokens[i] == top[1]["id"], (i, top, tokens)
        assert top[0]["logprob"] - top[1]["logprob"] < TIE, (i, top)


def sse_data(r: httpx.Response) -> Iterator[dict[str, Any]]:
    """Each event's JSON; comment lines (keep-alives) skipped."""
    for line in r.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: ") :])


def test_each_kind_of_speculation_gives_the_same_greedy_tokens(pair: httpx.Client) -> None:
    drafted0 = metric(pair, "polykv_spec_draft_tokens_total")
    accepted0 = metric(pair, "polykv_spec_accepted_tokens_total")
    stats = []
    for prompt in PROMPTS:
        plain = complete(pair, prompt, "none")
        assert "draft_n" not in plain["timings"]
        for kind in ("ngram", "draft"):
            out = complete(pair, prompt, kind)
            assert_same_greedy(plain, out["tokens"])
            t = out["timings"]
            assert t["predicted_n"] == N
            assert 0 <= t.get("draft_n_accepted", 0) <= t.get("draft_n", 0), t
            slot = next(s for s in pair.get("/slots").json() if s["id"] == out["id_slot"])
            assert slot["speculative"] is True
            assert (slot["draft_n"], slot["draft_n_accepted"]) == (
                t.get("draft_n", 0),
                t.get("draft_n_accepted", 0),
            )
            stats.append((kind, t.get("draft_n", 0), t.get("draft_n_accepted", 0)))
    # The Q4_1 guesses of the Q8_0 network: drafted on every text, most of them kept.
    model = [(d, a) for kind, d, a in stats if kind == "draft"]
    assert all(d > 0 for d, _ in model), stats
    assert sum(a for _, a in model) > sum(d for d, _ in model) // 2, stats
    assert any(kind == "ngram" and a > 0 for kind, _, a in stats), stats  # the echoed call
    assert metric(pair, "polykv_spec_draft_tokens_total") - drafted0 == sum(d for _, d, _ in stats)
    assert metric(pair, "polykv_spec_accepted_tokens_total") - accepted0 == sum(
        a for _, _, a in stats
    )
    check_accounting(pair)


def test_drafted_sessions_batched_and_streamed_match_their_solo_runs(pair: httpx.Client) -> None:
    solo = [complete(pair, p, "none") for p in PROMPTS]

    def streamed(i: int) -> list[int]:
        body = {"prompt": PROMPTS[i], "n_predict": N, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False, "stream": True, "speculative.type": "draft",
                "session_id": f"spec-pair-{i}"}  # fmt: skip
        tokens: list[int] = []
        with pair.stream("POST", "/completion", json=body) as r:
            assert r.status_code == 200
            for ev in sse_data(r):
                tokens += ev.get("tokens") or []
                if ev.get("stop"):
                    assert ev["timings"]["draft_n"] > 0, ev["timings"]
        return tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(streamed, range(len(PROMPTS))))
    for plain, tokens in zip(solo, batched, strict=True):
        assert_same_greedy(plain, tokens)
    tps = pair.get("/polykv/tps").json()
    sessions = {s["session_id"]: s for s in tps["sessions"]}
    for i in range(len(PROMPTS)):
        s = sessions[f"spec-pair-{i}"]
        assert 0 <= s["draft_n_accepted"] <= s["draft_n"] and s["draft_n"] > 0, s
    check_accounting(pair)


def test_chat_completions_report_the_drafts(pair: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": N,
            "temperature": 0, "ignore_eos": True, "speculative.type": "draft"}  # fmt: skip
    r = pair.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == N
    t = r.json()["timings"]
    assert 0 < t["draft_n_accepted"] <= t["draft_n"], t
