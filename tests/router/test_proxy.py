"""The router in front of real engine processes (static replicas, no Kubernetes): streaming
pass-through, the refusal paths, re-homing, a router restart, and every request field or
header the router reads, refused where it is malformed.

The engines run the generated test model with f32 KV (greedy output is then the same for
the same prompt, whichever way it reaches the engine). Waits are on conditions, never sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess
from polykv_testenv.waiting import wait_for

from .helpers import (
    PREFIX,
    RouterProcess,
    assert_same_stream,
    create_pool,
    metrics,
    pool_prefix,
    saturate,
    total,
)

ENGINE_ARGS = ("-np", "2", "-c", "4096", "-t", "1", "--metrics", "-ctk", "f32", "-ctv", "f32")
ROUTER_KEY = "router-identity-for-tests"
"""The router's identity: the engines honour its re-homes only with it (POLYKV_ROUTER_KEY
on both sides, as the operator wires them)."""
IDENTITY = {"POLYKV_ROUTER_KEY": ROUTER_KEY}

StartFleet = Callable[..., dict[str, EngineProcess]]
StartRouter = Callable[..., RouterProcess]


@pytest.fixture
def start_fleet(test_model: Path, tmp_path: Path) -> Iterator[StartFleet]:
    started: list[EngineProcess] = []

    def start(
        *names: str, pool: str | None = None, args: tuple[str, ...] = ()
    ) -> dict[str, EngineProcess]:
        """Engines by name, each holding ``pool`` when one is named; ``args``: more flags."""
        out = {}
        for name in names:
            eng = EngineProcess(
                model=test_model,
                args=(*ENGINE_ARGS, *args),
                log_path=tmp_path / f"{name}.log",
                env=IDENTITY,
            )
            eng.start(timeout=120)
            started.append(eng)
            out[name] = eng
            if pool is not None:
                create_pool(client(eng.base_url), pool)
        return out

    yield start
    for eng in started:
        eng.stop()


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[StartRouter]:
    started: list[RouterProcess] = []

    def start(replicas: dict[str, str], *args: str) -> RouterProcess:
        log = tmp_path / f"router-{len(started)}.log"
        r = RouterProcess(replicas, log, args, env=IDENTITY).start()
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()
        print(f"router log: {r.log_path}")


def urls(engines: dict[str, EngineProcess]) -> dict[str, str]:
    return {name: e.base_url for name, e in engines.items()}


def client(base_url: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, timeout=120)


def turn(
    c: httpx.Client,
    session: str | None,
    pool: str | None,
    text: str,
    headers: dict[str, str] | None = None,
    **kw: Any,
) -> httpx.Response:
    prefix = pool_prefix(pool) if pool is not None else PREFIX
    body: dict[str, Any] = {"prompt": f"{prefix} {text}", "n_predict": 4, "temperature": 0, **kw}
    if pool is not None:
        body["pool_id"] = pool
    sent = {"x-session-id": session} if session else {}
    return c.post("/completion", json=body, headers={**sent, **(headers or {})})


# ------------------------------------------------------------------------ streaming


CHUNKS = [
    b'data: {"content": "a"}\n\n',
    b'data: {"content": "caf\xc3',  # an event, and a UTF-8 character, split across chunks
    b'\xa9"}\n\ndata: {"content": "\\r\\n"}\r\n\r\n',
    b"data: [DONE]\n\n",
]


class _GatedStream(BaseHTTPRequestHandler):
    """Sends CHUNKS one at a time, each only after the client has received the previous one
    (the test says so through ``server.released``): a router that buffered would stall."""

    protocol_version = "HTTP/1.1"
    server: Any

    def do_GET(self) -> None:
        # An upstream without keys: the router's key check (GET /v1/models) passes.
        ok = self.path == "/v1/models"
        body = b'{"object": "list", "data": []}' if ok else b"{}"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-upstream", "gated")
        self.end_headers()
        for i, chunk in enumerate(CHUNKS):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            if i + 1 < len(CHUNKS) and not self.server.released[i].wait(60):
                return  # never released: the router held chunk i back
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


def test_sse_is_relayed_byte_for_byte_and_chunk_by_chunk(start_router: StartRouter) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GatedStream)
    server.released = [threading.Event() for _ in CHUNKS]  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        router = start_router({"up": f"http://127.0.0.1:{server.server_address[1]}"})
        got = b""
        bounds = [sum(len(c) for c in CHUNKS[: i + 1]) for i in range(len(CHUNKS))]
        with httpx.stream(
            "POST",
            router.base_url + "/completion",
            json={"prompt": "x", "stream": True},
            timeout=120,
        ) as r:
            assert r.status_code == 200
            assert r.headers["x-upstream"] == "gated"
            assert r.headers["x-polykv-replica"] == "up"
            assert r.headers["content-type"] == "text/event-stream"
            for piece in r.iter_raw():
                got += piece
                for i, end in enumerate(bounds):
                    if len(got) >= end:
                        server.released[i].set()  # type: ignore[attr-defined]
        assert got == b"".join(CHUNKS)
    finally:
        server.shutdown()


def test_a_real_stream_through_the_router_matches_a_direct_one(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    engines = start_fleet("a")
    router = start_router(urls(engines))
    body = {
        "prompt": PREFIX,
        "n_predict": 24,
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
    }
    raw = {}
    for where, base in (("direct", engines["a"].base_url), ("router", router.base_url)):
        with httpx.stream("POST", base + "/completion", json=body, timeout=120) as r:
            assert r.status_code == 200
            raw[where] = r.read()
    assert_same_stream(raw["direct"], raw["router"], tokens=24)


# ------------------------------------------------------------------------ refusals


def test_an_engine_429_moves_the_session_to_the_next_replica(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    """The router's figures are stale (one poll an hour): it thinks a admits, a refuses for
    real, and the session lands on b in the same request."""
    engines = start_fleet("a", "b", pool="crew")
    router = start_router(urls(engines), "--poll-interval-ms", "3600000")
    rc = client(router.base_url)
    # The pool's figures are fetched on its first request; this one fails at the engine (no
    # reservation left behind), so a and b look alike and a, first by name, is tried first.
    first = turn(rc, None, "crew", "warm the router's view", temperature=-1)
    assert first.status_code == 400 and first.headers["x-polykv-replica"] == "a"
    saturate(client(engines["a"].base_url), "crew", settle_max_ms=2000)
    r = turn(rc, "s-retried", "crew", "hello")
    assert r.status_code == 200, r.text
    assert r.headers["x-polykv-replica"] == "b"
    text = metrics(router.base_url)
    assert total(text, "polykv_router_placements_total", result="retried") == 1
    assert total(text, "polykv_router_engine_refusals_total", reason="tps_floor") == 1
    assert total(metrics(engines["a"].base_url), "polykv_pool_rejects_total", pool="crew") == 1
    # Bound to b now: the next turn goes there without asking anyone.
    assert turn(rc, "s-retried", "crew", "hello again").headers["x-polykv-replica"] == "b"


def test_all_refuse_one_429_with_the_smallest_retry_after(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    engines = start_fleet("a", "b")
    for e, settle_ms in zip(engines.values(), (7000, 3000), strict=True):
        create_pool(client(e.base_url), "crew")
        saturate(client(e.base_url), "crew", settle_max_ms=settle_ms)
    router = start_router(urls(engines))
    rc = client(router.base_url)
    r = turn(rc, "s-new", "crew", "hello")
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "3"
    err = r.json()["error"]
    assert (err["reason"], err["type"], err["pool"]) == ("tps_floor", "rate_limit_error", "crew")
    assert "x-polykv-replica" not in r.headers
    text = metrics(router.base_url)
    assert total(text, "polykv_router_fleet_rejects_total", reason="tps_floor") == 1
    assert total(text, "polykv_router_engine_refusals_total", reason="tps_floor") == 2
    assert total(text, "polykv_router_placements_total", result="rejected") == 1
    for e in engines.values():  # each replica was asked once, and refused once
        assert total(metrics(e.base_url), "polykv_pool_rejects_total", pool="crew") == 1


# ------------------------------------------------------------------------ re-homing


def test_a_dead_replica_rehomes_its_session_past_the_gate(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    engines = start_fleet("a", "b", pool="crew")
    router = start_router(urls(engines))
    rc = client(router.base_url)
    r = turn(rc, "s1", "crew", "step 1")
    assert r.headers["x-polykv-replica"] == "a"
    # b now refuses every new session: only an ungated re-home can land there.
    saturate(client(engines["b"].base_url), "crew", settle_max_ms=2000)
    assert engines["a"].proc is not None
    engines["a"].proc.kill()
    engines["a"].proc.wait()
    r = turn(rc, "s1", "crew", "step 1 step 2")
    assert r.status_code == 200, r.text
    assert r.headers["x-polykv-replica"] == "b"
    assert total(metrics(router.base_url), "polykv_router_rehomes_total", reason="unreachable") == 1
    b_metrics = metrics(engines["b"].base_url)
    assert total(b_metrics, "polykv_pool_rehomed_sessions_total", pool="crew") == 1
    assert total(b_metrics, "polykv_pool_rejects_total", pool="crew") == 0
    # Rebound: the turn after is an ordinary continuation on b, reusing its cache.
    r = turn(rc, "s1", "crew", "step 1 step 2 step 3")
    assert r.headers["x-polykv-replica"] == "b"
    assert r.json()["timings"]["cache_n"] > 0
    assert total(metrics(router.base_url), "polykv_router_rehomes_total") == 1


def test_a_restarted_engine_rehomes_its_sessions(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    engines = start_fleet("a", "b")
    router = start_router(urls(engines), "--poll-interval-ms", "200")
    rc = client(router.base_url)
    assert turn(rc, "s1", None, "step 1").headers["x-polykv-replica"] == "a"
    a = engines["a"]
    old = httpx.get(a.base_url + "/props").json()["polykv"]["boot_id"]
    a.stop()
    a.start(timeout=120)  # same address, new process: the session's KV is gone
    new = httpx.get(a.base_url + "/props").json()["polykv"]["boot_id"]
    assert new != old
    wait_for(
        "router sees the new boot id",
        lambda: (
            (
                total(metrics(router.base_url), "polykv_router_replicas", state="serving") == 2
                and b'"engine restarted"' in router.log().encode()
            )
            or None
        ),
        timeout_s=60,
    )
    r = turn(rc, "s1", None, "step 1 step 2")
    assert r.status_code == 200
    assert total(metrics(router.base_url), "polykv_router_rehomes_total", reason="restarted") == 1


def test_a_session_saved_at_shutdown_follows_its_cache(
    start_fleet: StartFleet, start_router: StartRouter, tmp_path: Path
) -> None:
    """Engine a's session cache is written on SIGTERM to a directory c reads too (a claim a
    new pod mounts): its next turn goes to c, which restores it, not to b (first by name)."""
    shared = ("--polykv-snapshot-dir", str(tmp_path / "shared-store"))
    engines = {**start_fleet("a", args=shared), **start_fleet("b"), **start_fleet("c", args=shared)}
    router = start_router(urls(engines))
    rc = client(router.base_url)
    first = turn(rc, "s1", None, "step 1")
    assert first.headers["x-polykv-replica"] == "a"
    assert engines["a"].stop() == 0  # SIGTERM: the session's cache is written
    r = turn(rc, "s1", None, "step 1 step 2")
    assert r.status_code == 200, r.text
    assert r.headers["x-polykv-replica"] == "c"
    assert r.json()["timings"]["cache_n"] >= first.json()["tokens_evaluated"]
    assert total(metrics(engines["c"].base_url), "polykv_session_restores_total",
                 outcome="restored") == 1  # fmt: skip
    text = metrics(router.base_url)
    assert total(text, "polykv_router_rehomes_total", reason="unreachable") == 1


def test_a_restarted_router_finds_each_session_on_its_replica(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    engines = start_fleet("a", "b", pool="crew")
    router = start_router(urls(engines))
    rc = client(router.base_url)
    homes = {s: turn(rc, s, "crew", "step 1").headers["x-polykv-replica"] for s in ("s1", "s2")}
    assert set(homes.values()) == {"a", "b"}  # the second went where the first was not
    router.restart()
    for s, home in homes.items():
        r = turn(rc, s, "crew", "step 1 step 2")
        assert r.headers["x-polykv-replica"] == home
        assert r.json()["timings"]["cache_n"] > len(PREFIX) // 8  # its own KV, not a new slot
    text = metrics(router.base_url)
    assert total(text, "polykv_router_session_lookups_total", result="found") == 2
    assert total(text, "polykv_router_rehomes_total") == 0


# ------------------------------------------------------------------------ rejections


def test_every_field_and_header_the_router_reads_is_refused_when_malformed(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    engines = start_fleet("a", pool="crew")
    router = start_router(urls(engines), "--max-body-bytes", "4096")
    rc = client(router.base_url)

    def refused(r: httpx.Response, status: int, reason: str) -> None:
        assert r.status_code == status, r.text
        assert r.json()["error"]["reason"] == reason
        assert "x-polykv-replica" not in r.headers  # the router answered, no engine

    ok = {"prompt": "hi", "n_predict": 1}
    refused(
        rc.post("/completion", json=ok, headers={"x-session-id": "s" * 257}), 400, "invalid_request"
    )
    refused(rc.post("/completion", json={**ok, "session_id": "s" * 257}), 400, "invalid_request")
    refused(rc.post("/completion", json={**ok, "session_id": 12}), 400, "invalid_request")
    refused(rc.post("/completion", json={**ok, "pool_id": False}), 400, "invalid_request")
    refused(rc.post("/completion", json={**ok, "shared_pool_slot": -2}), 400, "invalid_request")
    refused(rc.post("/completion", content=b"{oops"), 400, "invalid_json")
    refused(rc.post("/v1/chat/completions", content=b"[]"), 400, "invalid_request")
    refused(rc.post("/completion", json={**ok, "prompt": "x" * 5000}), 413, "body_too_large")
    refused(rc.get("/v1/chat/completions"), 405, "method_not_allowed")
    refused(rc.get("/polykv/pools"), 404, "route_not_found")
    refused(rc.post("/polykv/pools", json={"name": "x", "prompt": "y"}), 404, "route_not_found")
    # 256 characters is the engine's limit too: accepted, and the engine serves it.
    r = rc.post("/completion", json=ok, headers={"x-session-id": "s" * 256})
    assert r.status_code == 200 and r.headers["x-polykv-replica"] == "a"
    # What only the engine knows passes through as the engine said it.
    r = rc.post("/completion", json={**ok, "pool_id": "nope"}, headers={"x-session-id": "s-404"})
    assert r.status_code == 404 and r.json()["error"]["reason"] == "pool_not_found"
    assert r.headers["x-polykv-replica"] == "a"
    r = rc.post("/completion", json={**ok, "temperature": -1})
    assert r.status_code == 400 and r.headers["x-polykv-replica"] == "a"
    # No binding from a failed request: a later valid turn is a new session, placed.
    assert rc.post("/completion", json=ok, headers={"x-session-id": "s-404"}).status_code == 200
    text = metrics(router.base_url)
    assert total(text, "polykv_router_placements_total", result="error") == 2
    assert total(text, "polykv_router_placements_total", result="placed") == 2
    assert total(text, "polykv_router_sessions") == 2


def test_a_client_cannot_mark_its_own_request_rehomed(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    engines = start_fleet("a")
    ec = client(engines["a"].base_url)
    create_pool(ec, "crew")
    saturate(ec, "crew", settle_max_ms=2000)
    router = start_router(urls(engines))
    body = {"pool_id": "crew", "prompt": pool_prefix("crew") + " sneak", "n_predict": 1}
    # Neither the marker nor a forged router identity gets past the router.
    headers = {"x-session-id": "sneaky", "x-polykv-rehomed": "1", "x-polykv-router-key": "x"}
    r = client(router.base_url).post("/completion", json=body, headers=headers)
    assert r.status_code == 429  # gated like any new session
    assert total(metrics(engines["a"].base_url), "polykv_pool_rehomed_sessions_total") == 0


def test_info_routes_reach_a_replica_and_health_endpoints_answer(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    engines = start_fleet("a")
    router = start_router(urls(engines))
    rc = client(router.base_url)
    models = rc.get("/v1/models")
    assert models.status_code == 200 and models.headers["x-polykv-replica"] == "a"
    tok = rc.post("/tokenize", json={"content": "hello"})
    assert tok.status_code == 200 and tok.json()["tokens"]
    assert rc.get("/healthz").json() == {"status": "ok"}
    ready = rc.get("/readyz").json()
    assert ready["replicas"] == {"serving": 1, "terminating": 0, "not_ready": 0}
    text = rc.get("/metrics").text
    assert total(text, "polykv_router_requests_total", route="/v1/models", status="200") == 1
    assert "session" not in "".join(ln for ln in text.splitlines() if "{" in ln and "s-" in ln)


# ------------------------------------------------------------------------ agent identity


def test_sub_agents_go_to_their_parents_replica(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    """A sub-agent's first request is placed where its parent lives (its prefix is resident
    there), whichever header names the parent; new sessions otherwise spread out."""
    engines = start_fleet("a", "b", pool="crew")
    router = start_router(urls(engines))
    rc = client(router.base_url)
    run = "cc-run-1"
    home = turn(rc, None, "crew", "plan", headers={"X-Claude-Code-Session-Id": run})
    home_replica = home.headers["x-polykv-replica"]
    assert home.headers["x-session-id"] == run
    other = turn(rc, "stranger", "crew", "plan").headers["x-polykv-replica"]
    assert other != home_replica  # placement alone would spread them
    # Two slots a replica: the run and one sub-agent stay bound.
    claude = {"X-Claude-Code-Session-Id": run, "x-claude-code-agent-id": "a1"}
    sub = turn(rc, None, "crew", "work", headers=claude)
    assert sub.headers["x-polykv-replica"] == home_replica
    assert sub.headers["x-session-id"] == f"{run}:a1"
    # Codex names the parent thread; a restarted router asks the replicas where it is.
    router.restart()
    codex = {"session-id": run, "thread-id": "cx-child", "x-codex-parent-thread-id": run}
    sub = turn(rc, None, "crew", "work", headers=codex)
    assert sub.headers["x-polykv-replica"] == home_replica
    r = turn(rc, None, None, "x", headers={"thread-id": "has space"})
    assert r.status_code == 400 and "thread-id" in r.json()["error"]["message"]


def test_custom_header_lists_route_place_and_release(
    start_fleet: StartFleet, start_router: StartRouter
) -> None:
    """The four header lists are flags (the router's as the engine's): a team's own headers
    name the session, qualify a sub-agent, name a parent and end a session; the default
    ones are then not read."""
    lists = {"session": "x-team-session", "agent": "x-team-agent",
             "parent": "x-team-parent,x-team-lead", "final": "x-team-done"}  # fmt: skip
    engine_flags = [a for k, v in lists.items() for a in (f"--polykv-{k}-headers", v)]
    engines = start_fleet("a", "b", pool="crew", args=tuple(engine_flags))
    router = start_router(urls(engines), *[a for k, v in lists.items()
                                           for a in (f"--{k}-headers", v)])  # fmt: skip
    rc = client(router.base_url)

    def bound() -> float:
        return total(metrics(router.base_url), "polykv_router_sessions")

    home = turn(rc, None, "crew", "plan", headers={"X-Team-Session": "lead"})
    assert home.status_code == 200 and home.headers["x-session-id"] == "lead"
    home_replica = home.headers["x-polykv-replica"]
    assert bound() == 1
    # A default header is not a session here: a one-shot request, bound nowhere.
    oneshot = turn(rc, None, "crew", "plan", headers={"X-Claude-Code-Session-Id": "cc"})
    assert oneshot.status_code == 200 and "x-session-id" not in oneshot.headers
    assert bound() == 1
    other = turn(rc, None, "crew", "plan", headers={"x-team-session": "stranger"})
    assert other.headers["x-polykv-replica"] != home_replica  # placement alone spreads them
    # A sub-agent (the agent header qualifies the session) and a child naming its parent
    # by the second parent header both land where the lead lives.
    sub = turn(rc, None, "crew", "work", headers={"x-team-session": "lead", "x-team-agent": "a1"})
    assert sub.headers["x-session-id"] == "lead:a1"
    assert sub.headers["x-polykv-replica"] == home_replica
    child = turn(rc, None, "crew", "work", headers={"x-team-session": "kid", "x-team-lead": "lead"})
    assert child.headers["x-polykv-replica"] == home_replica
    # The final header ends the session on the engine and in the router's table.
    before = bound()
    done = turn(rc, None, "crew", "bye", headers={"x-team-session": "kid", "x-team-done": "1"})
    assert done.status_code == 200
    assert bound() == before - 1
    gone = client(engines[home_replica].base_url).get("/polykv/sessions/kid")
    assert gone.status_code == 404
    r = turn(rc, None, None, "x", headers={"x-team-agent": "a2", "x-team-session": "bad id"})
    assert r.status_code == 400 and "x-team-session" in r.json()["error"]["message"]
