"""Completion routes through HTTP: shapes, streaming, stops, sessions, prompt cache."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from polykv_engine.testing import EngineProcess

from .conftest import DETERMINISTIC, greedy


def sse_events(resp: httpx.Response) -> Iterator[str]:
    """Yield each SSE ``data:`` payload; asserts the framing is well formed."""
    buf = ""
    for chunk in resp.iter_text():
        buf += chunk
        while "\n\n" in buf:
            event, buf = buf.split("\n\n", 1)
            assert event.startswith("data: "), f"bad SSE event: {event!r}"
            yield event[len("data: ") :]
    assert buf == "", f"trailing bytes after the last event: {buf!r}"


def test_native_completion_shape(client: httpx.Client) -> None:
    r = client.post("/completion", json=greedy("Hello world", n=16))
    assert r.status_code == 200
    body = r.json()
    assert body["stop"] is True
    assert body["tokens_predicted"] == 16 == len(body["tokens"])
    assert body["stop_type"] == "limit"
    t = body["timings"]
    for key in (
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "cache_n",
    ):
        assert key in t
    assert t["predicted_n"] == 16
    assert t["prompt_n"] + t["cache_n"] == body["tokens_evaluated"]


def test_streaming_matches_non_streaming(client: httpx.Client) -> None:
    body = greedy("Streaming should not change the text", n=40, cache_prompt=False)
    whole = client.post("/completion", json=body).json()
    pieces: list[str] = []
    final = None
    with client.stream("POST", "/completion", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for data in sse_events(resp):
            ev = json.loads(data)
            if ev["stop"]:
                final = ev
            else:
                pieces.append(ev["content"])
    assert final is not None and final["timings"]["predicted_n"] == 40
    assert "".join(pieces) == whole["content"]


def test_a_stream_interval_groups_writes_not_events(
    start_engine: Callable[..., EngineProcess],
) -> None:
    """With tokens sent together every 300 ms, each token is still its own SSE event, in
    order, and the text is the whole response's; the first arrives before the rest (at once,
    not after an interval), and the chat route streams through it too."""
    eng = start_engine("--polykv-stream-interval-ms", "300", "-np", "2", *DETERMINISTIC)
    with httpx.Client(base_url=eng.base_url, timeout=120.0) as client:
        body = greedy("Streaming should not change the text", n=64, cache_prompt=False)
        whole = client.post("/completion", json=body).json()
        pieces: list[str] = []
        tokens: list[int] = []
        reads: list[int] = []  # events per network read
        with client.stream("POST", "/completion", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            buf = ""
            for chunk in resp.iter_text():
                buf += chunk
                events, _, buf = buf.rpartition("\n\n")
                got = [json.loads(e[len("data: ") :]) for e in events.split("\n\n") if e]
                reads.append(len(got))
                for ev in got:
                    if not ev["stop"]:
                        pieces.append(ev["content"])
                        tokens.extend(ev["tokens"])
            assert buf == ""
        assert "".join(pieces) == whole["content"] and tokens == whole["tokens"]
        assert len(tokens) == 64
        assert reads[0] == 1  # the first token went out alone
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
        }
        with client.stream("POST", "/v1/chat/completions", json=chat) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_oai_chat_stream_ends_with_done(client: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        events = list(sse_events(resp))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 12
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and "timings" in finals[0]


def test_stop_string_ends_generation_without_it(client: httpx.Client) -> None:
    base = client.post("/completion", json=greedy("Stop words: ", n=40)).json()["content"]
    assert len(base) > 6
    stop = base[3:6]
    r = client.post("/completion", json=greedy("Stop words: ", n=40, stop=[stop])).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == stop
    assert r["content"] == base[: base.index(stop)]


def test_session_keeps_its_slot_and_reuses_the_cache(client: httpx.Client) -> None:
    first_prompt = "Turn one of a long agent conversation about KV caches. " * 4
    r1 = client.post(
        "/completion", json=greedy(first_prompt, n=8), headers={"x-session-id": "agent-7"}
    ).json()
    assert r1["session_id"] == "agent-7"
    n_prompt_1 = r1["timings"]["prompt_n"] + r1["timings"]["cache_n"]
    second_prompt = first_prompt + r1["content"] + " And turn two."
    r2 = client.post("/completion", json=greedy(second_prompt, n=8, session_id="agent-7")).json()
    assert r2["id_slot"] == r1["id_slot"]
    assert r2["timings"]["cache_n"] >= n_prompt_1
    slots = client.get("/slots").json()
    assert any(s["session_id"] == "agent-7" for s in slots)


def test_disconnect_mid_stream_frees_the_slot(engine: EngineProcess) -> None:
    body = greedy("A very long story: ", n=100000, ignore_eos=True, stream=True)
    with httpx.Client(base_url=engine.base_url, timeout=30) as c:
        with c.stream("POST", "/completion", json=body) as resp:
            events = sse_events(resp)
            for _ in range(5):
                next(events)
        # Leaving the block closed the connection; the slot must go idle promptly.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not any(s["is_processing"] for s in c.get("/slots").json()):
                break
            time.sleep(0.05)
        assert not any(s["is_processing"] for s in c.get("/slots").json())
        assert c.post("/completion", json=greedy("still serving", n=4)).status_code == 200


def test_context_fills_and_stops_cleanly(start_engine) -> None:  # type: ignore[no-untyped-def]
    eng = start_engine("-np", "1", "-c", "256")
    with httpx.Client(base_url=eng.base_url, timeout=60) as c:
        r = c.post("/completion", json=greedy("fill the context ", n=1000, ignore_eos=True))
        body = r.json()
        assert r.status_code == 200
        assert body["truncated"] is True and body["stop_type"] == "limit"
        assert body["tokens_evaluated"] + body["tokens_predicted"] <= 256 + 1
        assert c.post("/completion", json=greedy("next", n=4)).status_code == 200


def test_tokenize_detokenize_round_trip(client: httpx.Client) -> None:
    text = "Pools share prefixes — ünïcödé, tabs\tand\nnewlines."
    toks = client.post("/tokenize", json={"content": text}).json()["tokens"]
    assert all(isinstance(t, int) for t in toks)
    assert client.post("/detokenize", json={"tokens": toks}).json()["content"] == text
    pieces = client.post("/tokenize", json={"content": "ab", "with_pieces": True}).json()
    assert all({"id", "piece"} <= set(p) for p in pieces["tokens"])


def test_info_routes(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    props = client.get("/props").json()
    assert props["total_slots"] == 4
    pk = props["polykv"]
    assert pk["n_parallel"] == 4 and pk["max_pools"] == 16 and pk["seq_ids_max"] == 20
    assert len(pk["boot_id"]) == 32
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"].endswith(".gguf")
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all("tps_ewma" in s for s in slots)


def test_session_signals_travel_in_headers_stream_and_not(client: httpx.Client) -> None:
    """x-session-tps, x-polykv-ctx-headroom and x-polykv-compaction-pressure on every response
    (the first SSE response too): clients that drop unknown body fields still see them."""
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 24,
            "temperature": 0, "session_id": "signals-1"}  # fmt: skip
    first = client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200
    tps = float(first.headers["x-session-tps"])
    assert tps > 0  # the turn just measured
    headroom = int(first.headers["x-polykv-ctx-headroom"])
    n_ctx = client.get("/props").json()["default_generation_settings"]["n_ctx"]
    # the slot holds the prompt and every decoded token (the last sampled one is not in KV)
    assert n_ctx - first.json()["usage"]["total_tokens"] <= headroom < n_ctx
    assert 0.0 <= float(first.headers["x-polykv-compaction-pressure"]) <= 1.0
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        # At the start of a stream: the session's rate at the end of its previous turn.
        assert float(r.headers["x-session-tps"]) == pytest.approx(tps, rel=1e-2)
        assert int(r.headers["x-polykv-ctx-headroom"]) > 0
        assert "x-polykv-compaction-pressure" in r.headers
        r.read()


def test_sessions_report_time_to_first_token(client: httpx.Client) -> None:
    client.post("/polykv/pools", json={"prompt": "ttft pool prefix", "name": "ttft"})
    r = client.post(
        "/completion", json=greedy("ttft pool prefix and more", 2, pool_id="ttft", session_id="t1")
    )
    assert r.status_code == 200
    pool = client.get("/polykv/pools/ttft").json()
    (session,) = pool["sessions"]
    assert session["ttft_ms"] is not None and session["ttft_ms"] > 0
