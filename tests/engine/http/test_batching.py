"""Continuous batching must be invisible: a request returns the same text batched or alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from polykv_engine.core.config import EngineConfig
from polykv_engine.core.engine import ARRIVAL_GATHER_S, Engine
from polykv_engine.core.tasks import DoneEvent, Event, GenerateTask, TokenEvent
from polykv_engine.llama.runtime import RuntimeConfig
from polykv_engine.llama.sampling import SamplingParams, StopParams
from polykv_engine.testing import EngineProcess

from .conftest import greedy
from .test_parking import metric

PROMPTS = [
    "The quick brown fox",
    "In a distant galaxy, the engineers of the fleet decided that every ship",
    "def fibonacci(n):\n    ",
    "Once upon a time there was a kernel that scheduled " * 6,
    "Shared prefixes make multi-agent serving cheap because",
    "A",
]


def complete(base_url: str, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(f"{base_url}/completion", json=body, timeout=120.0)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


def test_concurrent_greedy_requests_match_solo_runs(engine: EngineProcess) -> None:
    # cache_prompt off so each solo run prefills from scratch, like the batched one.
    bodies = [greedy(p, n=32, cache_prompt=False) for p in PROMPTS]
    solo = [complete(engine.base_url, b)["content"] for b in bodies]
    # 6 requests on 4 slots: two of them must queue, and still come out identical.
    with ThreadPoolExecutor(len(bodies)) as pool:
        batched = list(pool.map(lambda b: complete(engine.base_url, b)["content"], bodies))
    assert batched == solo
    assert all(isinstance(s, str) and s for s in solo)


def test_prompts_joining_mid_flight_match_solo_runs(engine: EngineProcess) -> None:
    long_body = greedy("Long running generation: ", n=400, cache_prompt=False)
    short_bodies = [greedy(p, n=20, cache_prompt=False) for p in PROMPTS[:3]]
    solo_long = complete(engine.base_url, long_body)["content"]
    solo_short = [complete(engine.base_url, b)["content"] for b in short_bodies]

    results: dict[str, object] = {}

    def run_long() -> None:
        results["long"] = complete(engine.base_url, long_body)["content"]

    t = threading.Thread(target=run_long)
    t.start()
    # Wait until the long request is decoding, then send prompts that must join its batches.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        slots = httpx.get(f"{engine.base_url}/slots").json()
        if any(s["state"] == "decoding" for s in slots):
            break
        time.sleep(0.005)
    with ThreadPoolExecutor(3) as pool:
        joined = list(pool.map(lambda b: complete(engine.base_url, b)["content"], short_bodies))
    t.join()
    assert joined == solo_short
    assert results["long"] == solo_long


def test_requests_beyond_parallel_queue_and_all_complete(engine: EngineProcess) -> None:
    bodies = [greedy(f"request number {i}: ", n=8) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda b: complete(engine.base_url, b), bodies))
    assert len(outs) == 12
    assert all(o["stop"] is True and o["tokens_predicted"] == 8 for o in outs)


# ----------------------------------------------------------------- requests that arrive together


class _Collect:
    """An in-process task's sink: keeps its events."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def emit(self, event: Event) -> None:
        self.events.append(event)
        if not isinstance(event, TokenEvent):
            self.done.set()

    def flush(self) -> None:
        return None


def _task(rt_tokens: list[int], n: int) -> tuple[GenerateTask, _Collect]:
    sink = _Collect()
    task = GenerateTask(
        prompt=rt_tokens,
        sampling=SamplingParams(temperature=0.0),
        stop=StopParams(n_predict=n, ignore_eos=True),
        sink=sink,
        cache_prompt=False,
    )
    return task, sink


def test_requests_handed_over_while_the_engine_gathers_share_its_first_step(
    test_model: Path,
) -> None:
    cfg = EngineConfig(
        runtime=RuntimeConfig(model_path=test_model, n_ctx=2048, n_seq_max=4), n_parallel=4
    )
    engine = Engine(cfg)
    n = 6
    first, first_sink = _task([1, 11, 12, 13], n)
    rest = [_task([1, 20 + i, 30 + i, 40 + i, 50 + i], n) for i in range(3)]
    limits: list[float] = []

    def barrier(limit_s: float) -> None:
        # The server's loop finishing the handlers of the same burst: on the first call only.
        limits.append(limit_s)
        if len(limits) == 1:
            for task, _ in rest:
                engine.submit(task)

    engine.arrival_barrier = barrier
    engine.start()
    try:
        assert engine.wait_ready(120)
        engine.submit(first)
        for sink in [first_sink, *(s for _, s in rest)]:
            assert sink.done.wait(120)
            assert isinstance(sink.events[-1], DoneEvent), sink.events[-1]
        counters = engine.call(lambda e: e.snapshot.counters).result(60)
    finally:
        engine.stop()
    # One step prefilled all four prompts, then n - 1 steps decoded all four together: the
    # first request did not start alone with the others a step behind it.
    assert counters.decode_calls == n, counters.decode_calls
    # Called again after the hand-over (it brought new requests), never past the limit.
    assert len(limits) == 2 and all(0 < x <= ARRIVAL_GATHER_S for x in limits), limits


def test_a_burst_read_in_one_go_is_prefilled_in_one_step(engine: EngineProcess) -> None:
    """Four requests already in the engine's sockets when its process resumes: the server
    reads them one at a time, and the engine takes all four into its first step."""
    n = 6
    bodies = [greedy(f"burst request {i}: " + "word " * (3 + i), n=n, cache_prompt=False)
              for i in range(4)]  # fmt: skip
    with httpx.Client(base_url=engine.base_url, timeout=60.0) as c:
        before = metric(c, "polykv_decode_calls_total")
        assert engine.proc is not None
        socks = []
        os.kill(engine.proc.pid, signal.SIGSTOP)
        try:
            for body in bodies:  # the kernel completes the connects and buffers the bytes
                payload = json.dumps(body).encode()
                s = socket.create_connection(("127.0.0.1", engine.port), timeout=60)
                s.sendall(
                    b"POST /completion HTTP/1.1\r\nHost: engine\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\n"
                    + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                socks.append(s)
        finally:
            os.kill(engine.proc.pid, signal.SIGCONT)
        replies = []
        for s in socks:
            with s:
                chunks = []
                while chunk := s.recv(65536):
                    chunks.append(chunk)
            replies.append(b"".join(chunks))
        assert all(r.startswith(b"HTTP/1.1 200") for r in replies), replies
        steps = metric(c, "polykv_decode_calls_total") - before
    assert steps == n, f"{steps} steps for four {n}-token requests that arrived together"
