"""Overload protection: a bounded queue, one running turn per session, keep-alives and a
write timeout on streams, and idle prompt caches that never block new sessions."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from polykv_engine.testing import EngineProcess

LONG = {"n_predict": 100_000, "ignore_eos": True, "temperature": 0}


def wait_for(pred: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or pred}")


@contextmanager
def running(base: str, body: dict[str, object]) -> Iterator[None]:
    """A request that keeps a slot busy until the block ends (its client disconnects)."""
    stop = threading.Event()

    def run() -> None:
        with (
            httpx.Client(base_url=base, timeout=120) as c,
            c.stream("POST", "/completion", json={**body, "stream": True}) as r,
        ):
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(60)


def busy_slots(c: httpx.Client) -> int:
    return sum(1 for s in c.get("/slots").json() if s["is_processing"])


def test_a_full_queue_answers_503_with_retry_after(
    start_engine: Callable[..., EngineProcess],
) -> None:
    eng = start_engine("-np", "1", "--polykv-max-queue", "1", "--metrics")
    with httpx.Client(base_url=eng.base_url, timeout=60) as c:
        with running(eng.base_url, {"prompt": "busy", **LONG}):
            wait_for(lambda: busy_slots(c) == 1, what="the slot busy")
            with running(eng.base_url, {"prompt": "queued", **LONG}):
                wait_for(lambda: "llamacpp:requests_deferred 1.0" in c.get("/metrics").text,
                         what="one request queued")  # fmt: skip
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    r = c.post("/completion", json={"prompt": "one more", "n_predict": 1})
                    if r.status_code == 503:
                        break
                assert r.status_code == 503, r.text
                assert r.json()["error"]["reason"] == "queue_full"
                assert int(r.headers["Retry-After"]) >= 1
        wait_for(lambda: busy_slots(c) == 0, what="slots free again")
        # The queued request's client left too; until the engine drops it the queue is full.
        wait_for(lambda: "llamacpp:requests_deferred 0.0" in c.get("/metrics").text,
                 what="the queue empty again")  # fmt: skip
        assert c.post("/completion", json={"prompt": "after", "n_predict": 1}).status_code == 200


def test_a_sessions_second_concurrent_turn_is_409(
    client: httpx.Client, engine: EngineProcess
) -> None:
    body = {"prompt": "turn one", "session_id": "one-at-a-time", **LONG}
    with running(engine.base_url, body):
        wait_for(lambda: any(s["session_id"] == "one-at-a-time" and s["is_processing"]
                             for s in client.get("/slots").json()))  # fmt: skip
        r = client.post("/completion", json={"prompt": "turn two", "n_predict": 2,
                                             "session_id": "one-at-a-time"})  # fmt: skip
        assert r.status_code == 409, r.text
        assert r.json()["error"]["reason"] == "session_busy" and r.headers["Retry-After"] == "1"
    wait_for(lambda: not any(s["is_processing"] for s in client.get("/slots").json()))
    r = client.post("/completion", json={"prompt": "turn two", "n_predict": 2,
                                         "session_id": "one-at-a-time"})  # fmt: skip
    assert r.status_code == 200


def test_a_queued_stream_gets_keep_alives(start_engine: Callable[..., EngineProcess]) -> None:
    eng = start_engine("-np", "1", "--sse-ping-interval", "0.2")
    with (
        httpx.Client(base_url=eng.base_url, timeout=60) as c,
        running(eng.base_url, {"prompt": "hold the slot", **LONG}),
    ):
        wait_for(lambda: busy_slots(c) == 1)
        body = {"prompt": "waiting", "n_predict": 2, "stream": True}
        with c.stream("POST", "/completion", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines) == ": keep-alive"


def test_a_client_that_stops_reading_is_dropped_and_its_slot_freed(
    start_engine: Callable[..., EngineProcess],
) -> None:
    eng = start_engine("-np", "1", "--timeout", "2", "-c", "4096")
    body = json.dumps({"prompt": "flood", "stream": True, "n_probs": 20, **LONG}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((eng.host, eng.port))
    sock.sendall(
        b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        with httpx.Client(base_url=eng.base_url, timeout=30) as c:
            wait_for(lambda: busy_slots(c) == 1, what="the stream started")
            # The client reads nothing: the engine's writes block, time out, and the turn is
            # cancelled well before the context would have ended it.
            wait_for(lambda: busy_slots(c) == 0, timeout=90, what="the stalled stream dropped")
            assert c.post("/completion", json={"prompt": "ok", "n_predict": 1}).status_code == 200
    finally:
        sock.close()


@pytest.mark.parametrize("policy", [{"target_tps_per_session": 1.0, "mode": "enforced"}])
def test_idle_caches_count_as_headroom(
    start_engine: Callable[..., EngineProcess], policy: dict[str, object]
) -> None:
    """One request with a huge max_tokens fills every cell; once it ends, its cache is only
    an optimisation: capacity still admits, and an enforced pool takes new sessions."""
    eng = start_engine("-np", "4", "-c", "2048", "--polykv-pool-grace-ms", "0")
    with httpx.Client(base_url=eng.base_url, timeout=120) as c:
        assert (
            c.post("/polykv/pools", json={"prompt": "floor pool", "name": "fl"}).status_code == 201
        )
        assert c.post("/polykv/pools/fl/admission", json=policy).status_code == 200
        r = c.post("/completion", json={"prompt": "runaway", "max_tokens": 100_000,
                                        "ignore_eos": True, "session_id": "big"})  # fmt: skip
        assert r.status_code == 200 and r.json()["truncated"] is True
        listing = c.get("/polykv/pools").json()
        assert listing["kv_cells_used"] > 1900  # the idle cache holds nearly every cell
        cap = c.get("/polykv/pools/fl/capacity").json()
        assert cap["can_admit"] is True and cap["kv_headroom_pct"] > 90, cap
        for i in range(3):
            r = c.post("/completion", json={"prompt": f"floor pool then {i}", "n_predict": 4,
                                            "pool_id": "fl", "session_id": f"new-{i}"})  # fmt: skip
            assert r.status_code == 200, r.text


def test_sessions_share_an_overloaded_engine_fairly(
    start_engine: Callable[..., EngineProcess],
) -> None:
    """Six agents loop turns on two slots. A session whose turn ends queues its next one
    behind the others (FIFO), so nobody monopolizes a slot by coming straight back:
    counted in completed turns, not in time."""
    eng = start_engine("-np", "2", "-c", "2048", "--metrics")
    n_sessions, total_turns = 6, 36
    done: dict[str, int] = {f"fair-{i}": 0 for i in range(n_sessions)}
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[str] = []

    def agent(session: str) -> None:
        with httpx.Client(base_url=eng.base_url, timeout=300) as c:
            turn = 0
            while not stop.is_set():
                body = {"prompt": f"{session} turn {turn}", "n_predict": 12, "ignore_eos": True,
                        "temperature": 0, "session_id": session}  # fmt: skip
                r = c.post("/completion", json=body)
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                turn += 1
                with lock:
                    done[session] += 1
                    if sum(done.values()) >= total_turns:
                        stop.set()

    threads = [threading.Thread(target=agent, args=(s,)) for s in done]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    turns = list(done.values())
    # Jain's fairness index: 1.0 when every session got the same number of turns.
    jain = sum(turns) ** 2 / (len(turns) * sum(t * t for t in turns))
    print(f"fairness: turns per session {sorted(turns)}, Jain index {jain:.3f}")
    assert jain >= 0.9 and min(turns) >= max(turns) // 2, done
