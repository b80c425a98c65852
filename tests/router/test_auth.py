"""The router's door, in front of real engine processes with keys: no work for a client
before an engine accepted its key, every map keyed by client input bounded, no replica
named on a refusal, and the router's identity on what it proxies (and only there).

Engine work is read from the engines' own counters (``polykv_http_requests_total`` by
route), never from the router's word.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess
from polykv_testenv.waiting import wait_for

from .helpers import RouterProcess, create_pool, metrics, pool_prefix, total

KEY = "tenant-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTER_KEY = "router-identity-for-tests"
ENGINE_ARGS = ("-np", "2", "-c", "2048", "-t", "1", "--metrics")
BURST = 200

StartEngine = Callable[..., EngineProcess]
StartRouter = Callable[..., RouterProcess]


@pytest.fixture
def start_engine(test_model: Path, tmp_path: Path) -> Iterator[StartEngine]:
    started: list[EngineProcess] = []

    def start(name: str, *args: str) -> EngineProcess:
        eng = EngineProcess(
            model=test_model,
            args=(*ENGINE_ARGS, *args),
            log_path=tmp_path / f"{name}.log",
            env={"POLYKV_ROUTER_KEY": ROUTER_KEY},
        )
        eng.start(timeout=120)
        started.append(eng)
        return eng

    yield start
    for eng in started:
        eng.stop()


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[StartRouter]:
    started: list[RouterProcess] = []

    def start(replicas: dict[str, str], *args: str, engine_key: str | None = KEY) -> RouterProcess:
        env = {"POLYKV_ROUTER_KEY": ROUTER_KEY}
        if engine_key is not None:
            env["POLYKV_ROUTER_ENGINE_API_KEY"] = engine_key
        log = tmp_path / f"router-{len(started)}.log"
        r = RouterProcess(replicas, log, args, env=env).start()
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()
        print(f"router log: {r.log_path}")


def engine_calls(base_url: str, route: str | None = None) -> float:
    """Requests the engine has answered (on ``route``, or on every route but /metrics and
    /props: the router's boot-id poll asks /props every round, whatever clients do). One
    scrape, so the poll cannot slip in between two readings."""
    text = metrics(base_url)
    if route is not None:
        return total(text, "polykv_http_requests_total", route=route)
    every = total(text, "polykv_http_requests_total")
    skip = sum(total(text, "polykv_http_requests_total", route=r) for r in ("/metrics", "/props"))
    return every - skip


def burst(base_url: str, headers_of: Callable[[int], dict[str, str]]) -> list[httpx.Response]:
    """BURST new-session requests, 8 at a time, each with its own session and its own pool
    (what used to cost a lookup on every replica and a poll of every pool)."""

    def one(i: int) -> httpx.Response:
        body = {"prompt": "hello", "n_predict": 1, "pool_id": f"pool-{i}"}
        headers = {"x-session-id": f"s-{i}", **headers_of(i)}
        return httpx.post(base_url + "/completion", json=body, headers=headers, timeout=60)

    with ThreadPoolExecutor(8) as ex:
        return list(ex.map(one, range(BURST)))


def assert_router_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"], err["reason"]) == (
        401,
        "authentication_error",
        "unauthorized",
    )
    assert "x-polykv-replica" not in r.headers


def test_unauthenticated_requests_cost_one_key_check_and_nothing_else(
    start_engine: StartEngine, start_router: StartRouter
) -> None:
    engines = {n: start_engine(n, "--api-key", KEY) for n in ("a", "b")}
    for e in engines.values():
        create_pool(httpx.Client(base_url=e.base_url, timeout=120), "crew", headers=AUTH)
    # A refusal remembered for the whole test (5 s by default: the burst takes longer on a
    # busy 2-core host, and each expiry is one more check), so every count below is exact.
    replicas = {n: e.base_url for n, e in engines.items()}
    router = start_router(replicas, "--poll-interval-ms", "200", "--key-refused-ttl-s", "600")
    bases = [e.base_url for e in engines.values()]

    def work() -> float:
        return sum(engine_calls(b) for b in bases)

    before = work()
    wrong = burst(router.base_url, lambda i: {"Authorization": "Bearer wrong"})
    for r in wrong:
        assert_router_401(r)
    print(f"{BURST} requests with one wrong key: {work() - before:.0f} engine calls")
    assert work() - before == 1  # one key check, cached for every later request
    keyless = burst(router.base_url, lambda i: {})
    assert all(r.status_code == 401 for r in keyless)
    assert work() - before == 2  # no key at all is one more verdict
    distinct = burst(router.base_url, lambda i: {"X-Api-Key": f"guess-{i}"})
    assert all(r.status_code == 401 for r in distinct)
    checks = sum(engine_calls(b, "/v1/models") for b in bases)
    print(f"{BURST} requests with distinct wrong keys: {work() - before - 2:.0f} engine calls")
    assert work() - before == 2 + BURST  # one check per distinct key: nothing else
    assert checks == 2 + BURST
    # Nothing was looked up or polled for them, now or in the poll rounds since.
    props = sum(engine_calls(b, "/props") for b in bases)
    wait_for(
        "three more poll rounds",
        lambda: sum(engine_calls(b, "/props") for b in bases) >= props + 6 or None,
        timeout_s=60,
    )
    assert work() - before == 2 + BURST
    text = metrics(router.base_url)
    assert total(text, "polykv_router_polled_pools") == 0
    assert total(text, "polykv_router_sessions") == 0
    assert total(text, "polykv_router_session_lookups_total") == 0
    assert total(text, "polykv_router_key_checks_total", result="refused") == 2 + BURST
    # The right key: checked once, then served.
    for i in range(3):
        body = {"prompt": pool_prefix("crew") + f" turn {i}", "n_predict": 1, "pool_id": "crew"}
        r = httpx.post(router.base_url + "/completion", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-polykv-replica"] in engines
    assert total(metrics(router.base_url), "polykv_router_key_checks_total", result="accepted") == 1


def test_an_open_engine_needs_no_key_and_polled_pools_are_bounded(
    start_engine: StartEngine, start_router: StartRouter
) -> None:
    eng = start_engine("a")
    create_pool(httpx.Client(base_url=eng.base_url, timeout=120), "crew")
    router = start_router({"a": eng.base_url}, "--max-polled-pools", "4", engine_key=None)
    with httpx.Client(base_url=router.base_url, timeout=60) as rc:
        body = {"prompt": pool_prefix("crew") + " hi", "n_predict": 1, "pool_id": "crew"}
        assert rc.post("/completion", json=body).status_code == 200
        # Any key, or none: the engine has none, and says so.
        r = rc.post("/completion", json=body, headers={"Authorization": "Bearer anything"})
        assert r.status_code == 200
        for i in range(10):  # pools that do not exist: the engine's 404, passed through
            r = rc.post("/completion", json={**body, "pool_id": f"nope-{i}"})
            assert r.status_code == 404 and r.json()["error"]["reason"] == "pool_not_found"
    text = metrics(router.base_url)
    assert total(text, "polykv_router_polled_pools") == 4
    assert total(text, "polykv_router_key_checks_total", result="accepted") == 2


def test_a_refusal_relayed_from_an_engine_names_no_replica(
    start_engine: StartEngine, start_router: StartRouter
) -> None:
    """The router trusts a key for its TTL; an engine that stopped accepting it meanwhile
    refuses the proxied request, and that 401 is relayed without naming the replica."""
    eng = start_engine("a", "--api-key", KEY)
    router = start_router({"a": eng.base_url})
    with httpx.Client(base_url=router.base_url, timeout=60) as rc:
        r = rc.post("/completion", json={"prompt": "hi", "n_predict": 1}, headers=AUTH)
        assert r.status_code == 200 and r.headers["x-polykv-replica"] == "a"
        eng.stop()
        eng.args = (*ENGINE_ARGS, "--api-key", "rotated-key")
        eng.start(timeout=120)  # same address, another key
        r = rc.post("/completion", json={"prompt": "hi", "n_predict": 1}, headers=AUTH)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error"
    assert "x-polykv-replica" not in r.headers


# ------------------------------------------------------------------------ tenants

TENANT_KEYS = "alpha: key-alpha\nbeta: key-beta\nops: key-ops\n"


def test_two_tenants_with_one_session_id_are_two_sessions(
    start_engine: StartEngine, start_router: StartRouter, tmp_path: Path
) -> None:
    """The engines keep one session per (tenant, id); so does the router. Before, its
    bindings and lookups went by the id alone (looked up with the router's own key): beta's
    "main" was taken for alpha's and sent to alpha's replica."""
    keys = tmp_path / "api.keys"
    keys.write_text(TENANT_KEYS)
    args = ("--api-key-file", str(keys), "--polykv-admin-key", "key-admin")
    engines = {n: start_engine(n, *args) for n in ("a", "b")}
    router = start_router({n: e.base_url for n, e in engines.items()}, engine_key="key-ops")
    alpha, beta = {"Authorization": "Bearer key-alpha"}, {"Authorization": "Bearer key-beta"}

    def turn(who: dict[str, str], text: str) -> str:
        body = {"prompt": text, "n_predict": 1}
        headers = {**who, "x-session-id": "main"}
        r = httpx.post(router.base_url + "/completion", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers["x-polykv-replica"]

    home = turn(alpha, "Alpha's first turn.")
    # Beta's "main" is beta's own: asked for with beta's key (found nowhere) and placed as a
    # new session, on the lighter replica.
    other = turn(beta, "Beta's first turn.")
    assert other != home
    text = metrics(router.base_url)
    assert total(text, "polykv_router_session_lookups_total", result="not_found") == 2
    assert total(text, "polykv_router_sessions") == 2
    assert turn(alpha, "Alpha's second turn.") == home
    # A restarted router asks again, each tenant with its own key, and finds each its own.
    router.restart()
    assert turn(beta, "Beta's second turn.") == other
    assert turn(alpha, "Alpha's third turn.") == home
    text = metrics(router.base_url)
    assert total(text, "polykv_router_session_lookups_total", result="found") == 2


# ------------------------------------------------------------------------ identity


class _Recorder(BaseHTTPRequestHandler):
    """An upstream that records the headers of every request it gets and answers like an
    engine without keys."""

    protocol_version = "HTTP/1.1"
    server: Any

    def _answer(self, doc: dict[str, Any]) -> None:
        self.server.seen.append((self.command, self.path, dict(self.headers.items())))
        raw = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self._answer({"object": "list", "data": []})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._answer({"content": "ok"})

    def log_message(self, *args: object) -> None:
        pass


def test_the_router_speaks_as_itself_only_on_what_it_proxies(start_router: StartRouter) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        router = start_router({"up": f"http://127.0.0.1:{server.server_address[1]}"})
        forged = {
            "Authorization": "Bearer client-key",
            "X-PolyKV-Router-Key": "forged",
            "x-polykv-rehomed": "1",
        }
        r = httpx.post(
            router.base_url + "/completion", json={"prompt": "x"}, headers=forged, timeout=60
        )
        assert r.status_code == 200, r.text
    finally:
        server.shutdown()
    seen = server.seen  # type: ignore[attr-defined]
    checks = [h for m, p, h in seen if (m, p) == ("GET", "/v1/models")]
    proxied = [h for m, p, h in seen if (m, p) == ("POST", "/completion")]
    assert len(checks) == 1 and len(proxied) == 1
    lower = [{k.lower(): v for k, v in h.items()} for h in (checks[0], proxied[0])]
    check, sent = lower
    # The key check carries the client's key and nothing of the router's.
    assert check["authorization"] == "Bearer client-key"
    assert "x-polykv-router-key" not in check
    # The proxied request: the client's key unchanged, the router's own identity, and
    # neither of the client's forged headers.
    assert sent["authorization"] == "Bearer client-key"
    assert sent["x-polykv-router-key"] == ROUTER_KEY
    assert "x-polykv-rehomed" not in sent
