"""The fake engine (fake_engine.py, behind the operator's unit tests) against a real one.

One scenario of pool API calls, the ones the operator's tests lean on, is replayed on the
fake and on a real polykv-engine (the generated test model, with an admin and an inference
key): each step must get the same HTTP status and the same reason code, and the relations
the operator reads must hold on both (an extension's branch position is the parent's length;
a dry run reports the prefix hash the create then has). Prefixes are token ids, which both
take as they are, so the fake's character tokenizer plays no part. A fake that drifts from
the engine fails here, not in production.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess

from .fake_engine import FakeEngine

ADMIN, API = "admin-key-contract", "api-key-contract"
N_CTX, MAX_POOLS = 2048, 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


A, C = toks(100, 20), toks(300, 10)


@dataclass(frozen=True)
class Step:
    what: str
    method: str
    path: str
    body: dict[str, Any] | None = None
    key: str | None = ADMIN


SCENARIO = (
    Step("create a root", "POST", "/polykv/pools", {"name": "root", "tokens": A}),
    Step("the same again", "POST", "/polykv/pools", {"name": "root", "tokens": A}),
    Step("same name, other prefix", "POST", "/polykv/pools", {"name": "root", "tokens": C}),
    Step("extend it", "POST", "/polykv/pools/root/fork", {"name": "ext", "tokens": A + C}),
    Step(
        "branch past the parent's end",
        "POST",
        "/polykv/pools/root/fork",
        {"name": "past", "tokens": A + C, "branch_pos": 25},
    ),
    Step("nothing in common", "POST", "/polykv/pools/root/fork", {"name": "x", "tokens": C}),
    Step("fork a missing pool", "POST", "/polykv/pools/nope/fork", {"name": "y", "tokens": A}),
    Step("dry run", "POST", "/polykv/pools", {"name": "dry", "tokens": C, "dry_run": True}),
    Step("create after the dry run", "POST", "/polykv/pools", {"name": "dry", "tokens": C}),
    Step(
        "too long for the context", "POST", "/polykv/pools", {"name": "big", "tokens": [5] * 4096}
    ),
    Step("release a parent", "DELETE", "/polykv/pools/root"),
    Step("release a missing pool", "DELETE", "/polykv/pools/nope"),
    Step("create with the inference key", "POST", "/polykv/pools", {"name": "k", "tokens": A}, API),
    Step("create with no key", "POST", "/polykv/pools", {"name": "k", "tokens": A}, None),
    Step("create with a wrong key", "POST", "/polykv/pools", {"name": "k", "tokens": A}, "bad"),
    Step("list with no key", "GET", "/polykv/pools", None, None),
    Step("list with the inference key", "GET", "/polykv/pools", None, API),
    Step("a pinned pool", "POST", "/polykv/pools", {"name": "pin", "tokens": A[:5], "pin": True}),
    Step("evict a pinned pool", "POST", "/polykv/pools/pin/evict", {}),
    Step("no sequence id left", "POST", "/polykv/pools", {"name": "over", "tokens": toks(7, 9)}),
    Step("release a leaf", "DELETE", "/polykv/pools/ext"),
    Step("then its parent", "DELETE", "/polykv/pools/root"),
)


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str | None
    body: dict[str, Any]


def replay(client: httpx.Client) -> list[Answer]:
    out = []
    for step in SCENARIO:
        headers = {"Authorization": f"Bearer {step.key}"} if step.key else {}
        r = client.request(step.method, step.path, json=step.body, headers=headers)
        body = r.json() if r.content else {}
        reason = body.get("error", {}).get("reason") if r.status_code >= 400 else None
        out.append(Answer(r.status_code, reason, body))
    return out


@pytest.fixture(scope="module")
def real_answers(
    test_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Answer]]:
    eng = EngineProcess(
        model=test_model,
        args=("-np", "2", "-c", str(N_CTX), "--polykv-max-pools", str(MAX_POOLS)),
        env={"POLYKV_ADMIN_KEY": ADMIN, "LLAMA_API_KEY": API},
        log_path=tmp_path_factory.mktemp("contract") / "engine.log",
    )
    eng.start()
    try:
        with httpx.Client(base_url=eng.base_url, timeout=60) as client:
            yield replay(client)
    finally:
        eng.stop()


def fake_answers() -> list[Answer]:
    fake = FakeEngine(n_ctx=N_CTX, max_pools=MAX_POOLS, admin_key=ADMIN, api_key=API)
    with httpx.Client(transport=httpx.MockTransport(fake), base_url="http://fake") as client:
        return replay(client)


def test_every_step_gets_the_engines_status_and_reason(real_answers: list[Answer]) -> None:
    fake = fake_answers()
    table = [
        (s.what, (r.status, r.reason), (f.status, f.reason))
        for s, r, f in zip(SCENARIO, real_answers, fake, strict=True)
    ]
    for row in table:
        print(row)
    assert [row for row in table if row[1] != row[2]] == []


def test_the_relations_the_operator_reads_hold_on_both(real_answers: list[Answer]) -> None:
    index = {s.what: i for i, s in enumerate(SCENARIO)}
    for answers in (real_answers, fake_answers()):
        ext = answers[index["extend it"]].body
        assert ext["branch_pos"] == len(A) and ext["prefix_len"] == len(A + C)
        dry = answers[index["dry run"]].body
        made = answers[index["create after the dry run"]].body
        assert dry["dry_run"] and not dry["created"] and made["created"]
        assert dry["prefix_hash"] == made["prefix_hash"]
        again = answers[index["the same again"]].body
        assert again["created"] is False
        assert again["prefix_hash"] == answers[index["create a root"]].body["prefix_hash"]
