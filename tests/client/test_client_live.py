"""The client against a real engine: typed results for every route, and the engine's own
refusals arriving as the typed exception of their reason code (sync and async alike)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polykv_api import models as wire
from polykv_client import (
    AsyncPolyKVClient,
    AuthError,
    EngineUnavailable,
    HasChildren,
    InvalidReference,
    InvalidRequest,
    NameConflict,
    PolyKVClient,
    PoolBusy,
    PoolNotFound,
    PoolSaturated,
    PoolsDisabled,
    PrefixMismatch,
    PrefixTooLong,
    SeqIdsExhausted,
    SessionNotFound,
    error_from_response,
)
from polykv_engine.testing import EngineProcess, free_port

from .conftest import ADMIN_KEY, API_KEY, MAX_POOLS

TEXT = "The shared instructions of every agent in this crew. " * 3


def test_pool_lifecycle_typed(admin: PolyKVClient) -> None:
    root = admin.create_pool(prompt=TEXT, name="root")
    assert root.created and root.pool is not None and root.pool.name == "root"
    again = admin.create_pool(prompt=TEXT, name="root")
    assert not again.created and again.pool_id == root.pool_id  # idempotent by name
    toks = admin.tokenize(TEXT, add_special=True)
    assert len(toks) == root.prefix_len
    child = admin.fork_pool("root", tokens=[*toks, *admin.tokenize(" More.")], name="child")
    assert child.branch_pos == root.prefix_len  # an extension: D = the parent's length
    assert admin.pin("child").pinned_explicit
    assert not admin.unpin("child").pinned_explicit
    detail = admin.get_pool("root")
    assert [d.name for d in detail.descendants] == ["child"]
    assert {p.name for p in admin.list_pools().pools} == {"root", "child"}
    cap = admin.capacity("child", expected_tokens=64)
    assert cap.can_admit and cap.pool_id == child.pool_id
    assert admin.tps().n_active == 0
    assert admin.release_subtree("root") == [child.pool_id, root.pool_id]  # leaves first
    assert admin.list_pools().pools == []
    assert admin.release_subtree("root") == []  # already gone: nothing to do


def test_async_client_runs_the_same_operations(engine: EngineProcess) -> None:
    async def go() -> list[str]:
        async with AsyncPolyKVClient(engine.base_url, admin_key=ADMIN_KEY) as c:
            await c.create_pool(messages=[{"role": "system", "content": "Be brief."}], name="a")
            await c.fork_pool("a", messages=[{"role": "system", "content": "Be brief. Or not."}],
                              name="b")  # fmt: skip
            names = [p.name or "" for p in (await c.list_pools()).pools]
            with pytest.raises(HasChildren):
                await c.release("a")
            await c.release_subtree("a")
            return names

    assert sorted(asyncio.run(go())) == ["a", "b"]


def test_refusals_arrive_typed(admin: PolyKVClient) -> None:
    root = admin.create_pool(prompt=TEXT, name="r")
    toks = admin.tokenize(TEXT, add_special=True)
    cases: list[tuple[type[Exception], str, object]] = [
        (PoolNotFound, "pool_not_found", lambda: admin.get_pool("ghost")),
        (NameConflict, "name_conflict", lambda: admin.create_pool(prompt="other", name="r")),
        (PrefixMismatch, "prefix_mismatch",
         lambda: admin.fork_pool("r", tokens=[toks[0], *reversed(toks[1:])], branch_pos=8)),
        (PrefixMismatch, "branch_pos_invalid",
         lambda: admin.fork_pool("r", tokens=[*toks, 5], branch_pos=root.prefix_len + 5)),
        (PrefixTooLong, "prefix_too_long", lambda: admin.create_pool(tokens=[5] * 5000)),
        (InvalidRequest, "token_invalid", lambda: admin.create_pool(tokens=[10**7])),
        (SessionNotFound, "session_not_found", lambda: admin.session("nobody")),
        (SessionNotFound, "session_not_found", lambda: admin.create_pool(from_session="nobody")),
        (PoolNotFound, "pool_not_found", lambda: admin.capacity("ghost")),
    ]  # fmt: skip
    for cls, reason, call in cases:
        with pytest.raises(cls) as info:
            call()  # type: ignore[operator]
        assert info.value.reason == reason, (reason, info.value)
    admin.pin("r")
    with pytest.raises(PoolBusy) as busy:
        admin.pool_action("r", "evict")
    assert busy.value.reason == "pool_pinned"
    admin.fork_pool("r", tokens=[*toks, 7], name="kid")
    with pytest.raises(HasChildren):
        admin.release("r")


def test_seq_ids_exhausted(admin: PolyKVClient) -> None:
    for i in range(MAX_POOLS):
        admin.create_pool(prompt=f"pool number {i}", name=f"p{i}")
    with pytest.raises(SeqIdsExhausted) as info:
        admin.create_pool(prompt="one too many", name="extra")
    assert info.value.status == 409


def test_keys(engine: EngineProcess, admin: PolyKVClient) -> None:
    with PolyKVClient(engine.base_url, api_key=API_KEY) as agent:
        assert agent.list_pools().pools == []  # reads take the inference key
        with pytest.raises(AuthError) as info:
            agent.create_pool(prompt=TEXT)
        assert info.value.reason == "forbidden" and info.value.status == 403
    with PolyKVClient(engine.base_url) as nobody, pytest.raises(AuthError) as info:
        nobody.list_pools()
    assert info.value.reason == "unauthorized"


EVIL = "../../slots/0?action=erase#"


def _slot_route_calls(engine: EngineProcess) -> float:
    text = httpx.get(engine.base_url + "/metrics", timeout=30).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("polykv_http_requests_total{") and 'route="/slots/{slot}"' in line
    )


def _slot0_used(engine: EngineProcess) -> int:
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    slots = httpx.get(engine.base_url + "/slots", headers=auth, timeout=30).json()
    return int(next(s for s in slots if s["id"] == 0)["ctx_used"])


def test_a_pool_name_cannot_steer_the_admin_key_to_another_route(
    engine: EngineProcess, admin: PolyKVClient
) -> None:
    """A name built to resolve to ``POST /slots/0?action=erase`` is refused by the client;
    the engine never sees that route and slot 0 keeps its cache."""
    r = httpx.post(
        engine.base_url + "/completion",
        json={"prompt": TEXT, "n_predict": 2, "id_slot": 0, "temperature": 0},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    used = _slot0_used(engine)
    assert used > 0
    calls = _slot_route_calls(engine)
    mutations = [
        lambda: admin.pin(EVIL),
        lambda: admin.pool_action(EVIL, "evict"),
        lambda: admin.release(EVIL),
        lambda: admin.release_subtree(EVIL),
        lambda: admin.fork_pool(EVIL, prompt=TEXT),
        lambda: admin.create_pool(prompt=TEXT, name=EVIL),
        lambda: admin.set_admission(EVIL, wire.AdmissionPolicy(target_tps_per_session=1.0)),
        lambda: admin.clear_admission(EVIL),
        lambda: admin.get_pool(EVIL),
        lambda: admin.capacity(EVIL),
        lambda: admin.session(".."),
    ]
    for call in mutations:
        with pytest.raises(InvalidReference):
            call()
    assert _slot_route_calls(engine) == calls  # the engine saw no /slots request
    assert _slot0_used(engine) == used
    assert admin.list_pools().pools == []
    # The observation can fail: the erase itself, sent on purpose, shows in both.
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(engine.base_url + "/slots/0?action=erase", headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    assert _slot_route_calls(engine) == calls + 1
    assert _slot0_used(engine) == 0


def test_no_engine_is_unavailable() -> None:
    with (
        PolyKVClient(f"http://127.0.0.1:{free_port()}", timeout=5) as c,
        pytest.raises(EngineUnavailable) as info,
    ):
        c.list_pools()
    assert info.value.status is None and "ConnectError" in info.value.message


def test_pools_disabled(test_model: Path) -> None:
    eng = EngineProcess(test_model, ("-np", "1", "--polykv-max-pools", "0"))
    eng.start()
    try:
        with PolyKVClient(eng.base_url) as c, pytest.raises(PoolsDisabled) as info:
            c.create_pool(prompt=TEXT)
        assert info.value.reason == "pools_disabled" and info.value.status == 501
    finally:
        eng.stop()


@pytest.fixture
def busy_pool(admin: PolyKVClient, engine: EngineProcess) -> Iterator[list[int]]:
    """An enforced pool with an unreachable floor and one session decoding in it."""
    admin.create_pool(prompt=TEXT, name="gated")
    admin.set_admission(
        "gated",
        wire.AdmissionPolicy(
            target_tps_per_session=1e9, mode="enforced", settle_tokens=8, settle_max_ms=1000
        ),
    )
    prompt = admin.tokenize(TEXT, add_special=True)
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=engine.base_url, timeout=60, headers=AUTH) as c:
            while not stop.is_set():
                body = {"prompt": [*prompt, 9], "n_predict": 400, "ignore_eos": True,
                        "pool_id": "gated", "session_id": "bg"}  # fmt: skip
                c.post("/completion", json=body).raise_for_status()

    t = threading.Thread(target=load)
    t.start()
    try:
        yield prompt
    finally:
        stop.set()
        t.join()


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_a_gate_refusal_is_pool_saturated(
    admin: PolyKVClient, engine: EngineProcess, busy_pool: list[int]
) -> None:
    # Generous deadline: this waits for the background session to be measured, on a shared CPU.
    deadline = 60.0
    cap = admin.capacity("gated")
    t0 = time.monotonic()
    while (cap.settling or cap.n_active < 1) and time.monotonic() - t0 < deadline:
        time.sleep(0.05)
        cap = admin.capacity("gated")
    assert not cap.can_admit and cap.reason_code == "tps_floor", cap
    body = {"prompt": [*busy_pool, 11], "n_predict": 4, "pool_id": "gated", "session_id": "new"}
    r = httpx.post(f"{engine.base_url}/completion", json=body, headers=AUTH, timeout=60)
    exc = error_from_response(r.status_code, r.headers, r.json())
    assert isinstance(exc, PoolSaturated), r.text
    assert exc.reason == "tps_floor" and exc.pool == "gated"
    assert exc.retry_after is not None and exc.retry_after >= 1
