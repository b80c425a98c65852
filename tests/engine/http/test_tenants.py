"""Isolation between tenants (API keys) on one engine replica.

Two tenants (``alpha`` with two keys, ``beta`` with one), the admin key and the router's key.
Tenant beta is the attacker throughout: it must not learn alpha's prompts from ``cache_n``,
see alpha's sessions in any listing, take over or lock out alpha's sessions by naming their
ids, or bypass an enforced admission floor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_api.models import PoolDetail, PoolList, TpsSnapshot
from polykv_engine.testing import EngineProcess
from polykv_engine.tokens import common_prefix_len

from .conftest import DETERMINISTIC
from .pool_helpers import ADMIN, create, release_all
from .test_admission import (
    Load,
    _metric,
    policy,
    saturated_pool,
    settled_and_active,
    wait_for,
)

KEY_FILE = """\
# tenant alpha has two keys, tenant beta one
alpha: key-a
alpha: key-a2

beta: key-b
"""
A, A2, B = "key-a", "key-a2", "key-b"
ROUTER = {"X-PolyKV-Router-Key": "router-key"}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api.keys"
    path.write_text(KEY_FILE)
    return path


@pytest.fixture(scope="module")
def tenant_engine(start_engine: Callable[..., EngineProcess], key_file: Path) -> EngineProcess:
    # No parking: an idle cache stays resident, where sharing would find it (a parked one
    # is out of reach while it is parked, which would hide the leak rather than close it).
    return start_engine(
        "-np", "4", "-c", "8192", "--metrics", "--api-key-file", str(key_file),
        "--polykv-admin-key", "admin-key", "--polykv-router-key", "router-key",
        "--polykv-park-mib", "0", *DETERMINISTIC,
    )  # fmt: skip


@pytest.fixture
def c(tenant_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tenant_engine.base_url, timeout=60) as client:
        release_all(client)
        for slot in client.get("/slots", headers=ADMIN).json():
            client.post(f"/slots/{slot['id']}?action=erase", headers=ADMIN)
        yield client
        release_all(client)


def tok(c: httpx.Client, key: str, text: str) -> list[int]:
    r = c.post("/tokenize", json={"content": text}, headers=auth(key))
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["tokens"]
    return tokens


def run(
    c: httpx.Client, key: str, prompt: Any, n: int = 4, headers: dict[str, str] | None = None,
    **extra: Any,
) -> httpx.Response:  # fmt: skip
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, **extra}
    return c.post("/completion", json=body, headers={**auth(key), **(headers or {})})


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def slot_of(c: httpx.Client, key: str, session: str) -> int:
    slot: int = ok(c.get(f"/polykv/sessions/{session}", headers=auth(key)))["slot"]
    return slot


SECRET = "The launch code of tenant alpha is seven three nine one, and only alpha knows it."
WRONG = 300  # a token no guess below continues the secret with


# ---------------------------------------------------------------------------- cache_n


def test_another_tenants_prompt_cannot_be_confirmed_from_cache_n(c: httpx.Client) -> None:
    secret = tok(c, A, SECRET)
    ok(run(c, A, secret, 2, session_id="a-secret"))
    sent: list[list[int]] = []  # beta's own earlier prompts: its cache may reuse those
    for k in (4, len(secret) // 2, len(secret) - 1):
        guess = secret[:k] + [WRONG]
        t = ok(run(c, B, guess, 1))["timings"]
        # Before: cache_n was k, so a guess was confirmed token by token. Now it covers at
        # most what beta itself sent before (its own cache), never what alpha sent.
        known = max((common_prefix_len(p, guess) for p in sent), default=0)
        assert t["cache_n"] <= known < k and t["prompt_n"] + t["cache_n"] == len(guess), (k, t)
        sent.append(guess)
    # The same tenant's other key still shares alpha's cells (sharing is not switched off).
    mine = ok(run(c, A2, secret[:-1] + [WRONG], 1))["timings"]
    assert mine["cache_n"] >= len(secret) - 2


def test_chat_cached_tokens_report_only_the_tenants_own_cache(c: httpx.Client) -> None:
    messages = [
        {"role": "system", "content": SECRET},
        {"role": "user", "content": "What is the code?"},
    ]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    first = c.post("/v1/chat/completions", json=body, headers=auth(A))
    assert first.status_code == 200, first.text
    guess = c.post("/v1/chat/completions", json=body, headers=auth(B))
    assert guess.status_code == 200, guess.text
    assert guess.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert guess.json()["timings"]["cache_n"] == 0
    again = c.post("/v1/chat/completions", json=body, headers=auth(A2))
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_naming_another_tenants_slot_is_refused_and_evicts_nothing(c: httpx.Client) -> None:
    secret = tok(c, A, SECRET)
    first = ok(run(c, A, secret, 2, session_id="a-slot"))
    slot = slot_of(c, A, "a-slot")
    # Before: beta took the slot, and alpha's idle cache went with it (first its guess was
    # answered from it; then it was dropped, at beta's will).
    r = run(c, B, secret[:-3] + [WRONG], 1, id_slot=slot)
    assert r.status_code == 409 and r.json()["error"]["reason"] == "slot_busy", r.text
    assert "another key" in r.json()["error"]["message"]
    # Alpha's session kept its slot and its whole cache.
    assert slot_of(c, A, "a-slot") == slot
    follow = secret + first["tokens"] + tok(c, A, " Again.")
    t = ok(run(c, A, follow, 1, session_id="a-slot"))["timings"]
    assert t["cache_n"] >= len(secret) + len(first["tokens"]) - 1, t
    # A slot of beta's own, or an empty one, is beta's to name.
    free = ok(c.post(f"/slots/{slot}?action=erase", headers=ADMIN))
    assert free["id_slot"] == slot
    assert ok(run(c, B, tok(c, B, "Beta's own."), 1, id_slot=slot))["id_slot"] == slot
    assert ok(run(c, B, tok(c, B, "Beta's own, again."), 1, id_slot=slot))["id_slot"] == slot


def test_a_pool_is_shared_by_naming_it_not_by_guessing_its_prompt(c: httpx.Client) -> None:
    prefix = tok(c, A, "Operator-declared instructions: answer briefly and politely. " * 3)
    create(c, tokens=prefix, name="declared")
    # Not naming the pool: its cells are not searched, so cache_n confirms nothing.
    t = ok(run(c, B, prefix + [WRONG], 1))["timings"]
    assert t["cache_n"] == 0, t
    # Naming it is what pools are for: any key attaches and is told what it shared.
    r = run(c, B, prefix + [WRONG], 1, pool_id="declared")
    assert ok(r)["timings"]["cache_n"] == len(prefix)
    assert int(r.headers["x-cached-prefix-tokens"]) == len(prefix)


# ---------------------------------------------------------------------------- listings

GRAMMAR = 'root ::= "alpha-grammar-x" | "alpha-grammar-y"'
STOP = "ALPHA-STOP-4417"


def test_listings_hide_other_tenants_sessions_grammar_and_stops(c: httpx.Client) -> None:
    ok(run(c, A, SECRET, 4, session_id="a-visible", grammar=GRAMMAR, stop=[STOP]))
    create(c, tokens=tok(c, A, "A pool everyone may attach. " * 3), name="vis-pool")
    ok(run(c, A, tok(c, A, "A pool everyone may attach. " * 3 + "Q"), 2,
           session_id="a-pooled", pool_id="vis-pool"))  # fmt: skip
    secrets = ("a-visible", "a-pooled", "alpha-grammar-x", STOP)
    routes = ("/slots", "/polykv/tps", "/polykv/pools", "/polykv/pools/vis-pool")
    for route in routes:
        theirs = c.get(route, headers=auth(B))
        assert theirs.status_code == 200, theirs.text
        leaked = [s for s in secrets if s in theirs.text]
        assert not leaked, (route, leaked)
        for key in (A, "admin-key"):  # alpha sees its own sessions; the admin sees all
            seen = c.get(route, headers=auth(key))
            assert "a-visible" in seen.text or "a-pooled" in seen.text, (route, key)
    # The shapes stay valid (ids are null where another tenant's session is listed)...
    PoolList.model_validate_json(c.get("/polykv/pools", headers=auth(B)).content)
    PoolDetail.model_validate_json(c.get("/polykv/pools/vis-pool", headers=auth(B)).content)
    TpsSnapshot.model_validate_json(c.get("/polykv/tps", headers=auth(B)).content)
    # ...and keep every session's figures: the counts the operator and agents read.
    admin_view = PoolList.model_validate_json(c.get("/polykv/pools", headers=ADMIN).content)
    beta_view = PoolList.model_validate_json(c.get("/polykv/pools", headers=auth(B)).content)
    assert len(beta_view.unpooled_sessions) == len(admin_view.unpooled_sessions) >= 1
    assert [len(p.sessions) for p in beta_view.pools] == [len(p.sessions) for p in admin_view.pools]
    slots = {s["id"]: s for s in c.get("/slots", headers=ADMIN).json()}
    assert any(s["params"].get("grammar") == GRAMMAR for s in slots.values())
    mine = c.get("/slots", headers=auth(A)).json()
    assert any(STOP in s["params"].get("stop", []) for s in mine)


def test_session_lookup_is_per_tenant_and_open_to_the_admin(c: httpx.Client) -> None:
    ok(run(c, A, SECRET, 2, session_id="a-where"))
    # The router asks with the client's own key: its identity widens nothing.
    for headers in (auth(B), {**auth(B), **ROUTER}):
        r = c.get("/polykv/sessions/a-where", headers=headers)
        assert r.status_code == 404 and r.json()["error"]["reason"] == "session_not_found"
    for headers in (auth(A), auth(A2), ADMIN):
        assert ok(c.get("/polykv/sessions/a-where", headers=headers))["session_id"] == "a-where"


# ---------------------------------------------------------------------------- sessions


def test_a_session_id_is_namespaced_by_tenant(c: httpx.Client) -> None:
    mine = tok(c, A, SECRET)
    first = ok(run(c, A, mine, 4, session_id="shared-name"))
    slot_a = slot_of(c, A, "shared-name")
    # Beta names the same id: a fresh session of its own, on another slot.
    theirs = ok(run(c, B, tok(c, B, "Beta has a different prompt entirely."), 4,
                    session_id="shared-name"))  # fmt: skip
    assert theirs["timings"]["cache_n"] == 0
    assert slot_of(c, B, "shared-name") != slot_a
    # Alpha's session kept its slot and its whole context: nothing was truncated.
    assert slot_of(c, A, "shared-name") == slot_a
    follow = mine + first["tokens"] + tok(c, A, " And then?")
    again = ok(run(c, A, follow, 2, session_id="shared-name"))
    assert again["timings"]["cache_n"] >= len(mine) + len(first["tokens"]) - 1, again["timings"]


def test_another_tenant_cannot_lock_a_running_session_out(
    c: httpx.Client, tenant_engine: EngineProcess
) -> None:
    def alpha_busy() -> bool:
        slots = c.get("/slots", headers=auth(A)).json()
        return any(s["session_id"] == "busy-name" and s["is_processing"] for s in slots)

    body = {"prompt": SECRET, "session_id": "busy-name", "n_predict": 100_000,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    stop = threading.Event()

    def alpha_turn() -> None:  # keeps alpha's session busy until the test is done
        with (
            httpx.Client(base_url=tenant_engine.base_url, timeout=120) as own,
            own.stream("POST", "/completion", json=body, headers=auth(A)) as r,
        ):
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    t = threading.Thread(target=alpha_turn, daemon=True)
    t.start()
    try:
        wait_for(alpha_busy, what="alpha's turn decoding")
        # Before: 409 session_busy, for as long as alpha kept the session busy.
        r = run(c, B, "Beta's own turn.", 2, session_id="busy-name")
        assert r.status_code == 200, r.text
        # Alpha's own second request is still refused: one turn at a time per session.
        r = run(c, A2, "A second alpha turn.", 2, session_id="busy-name")
        assert r.status_code == 409 and r.json()["error"]["reason"] == "session_busy"
        assert alpha_busy()  # all of it happened during alpha's turn
    finally:
        stop.set()
        t.join(60)


# ---------------------------------------------------------------------------- admission


def test_overcommit_and_rehomed_count_only_from_admin_or_router(c: httpx.Client) -> None:
    prompt = saturated_pool(c, "floor", guarantee_min_sessions=2)
    ok(run(c, "admin-key", prompt + [401], 4, pool_id="floor", session_id="floor-known"))
    with Load(c, "floor", prompt, ["floor-bg"]):
        wait_for(settled_and_active(c, "floor"))
        refused = run(c, B, prompt + [402], 4, pool_id="floor", session_id="b-plain")
        assert refused.status_code == 429, refused.text
        ignored_before = _metric(c, "polykv_ignored_overrides_total")
        for attempt in (
            run(c, B, prompt + [403], 4, pool_id="floor", session_id="b-oc", overcommit=True),
            run(c, B, prompt + [404], 4, {"x-polykv-rehomed": "1"}, pool_id="floor",
                session_id="b-rehomed"),
            run(c, B, prompt + [405], 4, {"X-PolyKV-Router-Key": "not-the-key"},
                pool_id="floor", session_id="b-forged", overcommit=True),
            # Naming the admin's known session is no continuation for beta.
            run(c, B, prompt + [406], 4, pool_id="floor", session_id="floor-known"),
        ):  # fmt: skip
            assert attempt.status_code == 429, attempt.text
            assert attempt.json()["error"]["reason"] == "tps_floor"
        assert _metric(c, "polykv_ignored_overrides_total") >= ignored_before + 3
        # The router vouches for a re-home or an overcommit; the admin may overcommit.
        rehomes = _metric(c, "polykv_pool_rehomed_sessions_total", pool="floor")
        ok(run(c, B, prompt + [407], 4, {**ROUTER, "x-polykv-rehomed": "1"}, pool_id="floor",
               session_id="b-moved"))  # fmt: skip
        assert _metric(c, "polykv_pool_rehomed_sessions_total", pool="floor") == rehomes + 1
        ok(run(c, B, prompt + [408], 4, ROUTER, pool_id="floor", session_id="b-routed-oc",
               overcommit=True))  # fmt: skip
        ok(run(c, "admin-key", prompt + [409], 4, pool_id="floor", session_id="adm-oc",
               overcommit=True))  # fmt: skip


@pytest.fixture(scope="module")
def queue_engine(start_engine: Callable[..., EngineProcess], key_file: Path) -> EngineProcess:
    return start_engine(
        "-np", "2", "-c", "4096", "--metrics", "--api-key-file", str(key_file),
        "--polykv-admin-key", "admin-key", "--polykv-max-queue", "1", *DETERMINISTIC,
    )  # fmt: skip


def test_requests_held_by_the_gate_count_against_the_queue_bound(
    queue_engine: EngineProcess,
) -> None:
    with httpx.Client(base_url=queue_engine.base_url, timeout=30) as c:
        prompt = tok(c, A, "A pool whose admits settle slowly. " * 3)
        create(c, tokens=prompt, name="held")
        policy(c, "held", target_tps_per_session=0.001, mode="enforced",
               guarantee_min_sessions=1, settle_tokens=100_000, settle_max_ms=60_000,
               on_saturation="queue", queue_max_ms=60_000)  # fmt: skip
        ok(run(c, A, prompt + [401], 1, pool_id="held", session_id="first"))  # opens a window
        result: dict[str, httpx.Response] = {}

        def held() -> None:
            with httpx.Client(base_url=queue_engine.base_url, timeout=120) as other:
                result["r"] = run(other, A, prompt + [402], 1, pool_id="held", session_id="2nd")

        t = threading.Thread(target=held)
        t.start()
        wait_for(lambda: _metric(c, "polykv_pool_holds_total", pool="held") >= 1)
        assert t.is_alive()
        # The one place in the queue (--polykv-max-queue 1) is the held request's.
        r = run(c, B, prompt + [403], 1, pool_id="held", session_id="3rd")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["reason"] == "queue_full" and r.headers["Retry-After"] == "2"
        assert "max_queue=1" in r.json()["error"]["message"]
        # Lifting the policy lets the held request go; the queue is free again.
        assert c.delete("/polykv/pools/held/admission", headers=ADMIN).status_code == 200
        t.join(60)
        assert result["r"].status_code == 200, result["r"].text
        ok(run(c, B, prompt + [404], 1, pool_id="held", session_id="4th"))


# ---------------------------------------------------------------------------- auth headers


@pytest.mark.parametrize("header", [b"Authorization", b"X-Api-Key"])
def test_a_key_that_is_not_utf8_is_a_401_without_a_traceback(
    tenant_engine: EngineProcess, header: bytes
) -> None:
    assert tenant_engine.log_path is not None
    logged = tenant_engine.log_path.stat().st_size
    value = b"Bearer \xff\xfe-key" if header == b"Authorization" else b"\xc3\x28key"
    with httpx.Client(base_url=tenant_engine.base_url, timeout=30) as c:
        r = c.get("/slots", headers=[(header, value)])
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
        assert c.get("/health").status_code == 200  # the engine carries on
    with tenant_engine.log_path.open("rb") as log:
        log.seek(logged)
        tail = log.read().decode(errors="replace")
    assert "Traceback" not in tail and "unhandled error" not in tail, tail
