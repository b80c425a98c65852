"""``PolyKVChatModel`` and ``CapacityGate`` against a real engine (SmolLM2-135M-Instruct):
pool attach, one engine session per thread, signals in metadata (invoke and stream), typed
gate refusals, and a gate node that waits until capacity returns."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.types import Command

from polykv_api import models as wire
from polykv_client import PolyKVClient, PoolSaturated
from polykv_engine.testing import EngineProcess
from polykv_langgraph import CapacityGate, PolyKVChatModel, PolyKVState, polykv_signals

pytestmark = pytest.mark.real_model

SYSTEM = "You are a helpful assistant. Answer in one short sentence."


def system(pool: str) -> str:
    # Each test's pool has its own prefix: a slot whose own cache already holds a prefix
    # serves it from there instead of attaching to a new pool with the same tokens.
    return f"Pool {pool}. {SYSTEM}"


def sys_msgs(pool: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system(pool)}]


def model(eng: EngineProcess, **kw: Any) -> PolyKVChatModel:
    return PolyKVChatModel(base_url=eng.base_url, temperature=0, max_tokens=24, **kw)


def thread(tid: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": tid}}


def ask(question: str, pool: str) -> list[BaseMessage]:
    return [SystemMessage(system(pool)), HumanMessage(question)]


def cache_read(msg: BaseMessage) -> int:
    usage = getattr(msg, "usage_metadata", None) or {}
    return int(usage.get("input_token_details", {}).get("cache_read", 0))


def test_first_turn_reads_the_pool_prefix_from_kv(smol: EngineProcess, pools: PolyKVClient) -> None:
    made = pools.create_pool(messages=sys_msgs("attach"), name="attach")
    llm = model(smol, pool_id="attach")
    reply = llm.invoke(ask("What is the capital of France?", "attach"), thread("attach-1"))
    assert cache_read(reply) >= made.prefix_len > 0
    signals = polykv_signals(reply)
    assert signals is not None
    assert signals.pool_id == made.pool_id and signals.cached_prefix_tokens == made.prefix_len
    assert signals.session_id == "attach-1"
    assert signals.session_tps is not None and signals.session_tps > 0
    assert signals.ctx_headroom is not None and 0 < signals.ctx_headroom < 8192
    assert signals.compaction_pressure is not None and 0 <= signals.compaction_pressure <= 1
    assert not signals.backpressure


def test_two_turns_on_one_thread_are_one_engine_session(
    smol: EngineProcess, pools: PolyKVClient
) -> None:
    made = pools.create_pool(messages=sys_msgs("turns"), name="turns")
    llm = model(smol, pool_id="turns")
    history = ask("Name a fruit that is yellow.", "turns")
    one = llm.invoke(history, thread("turns-1"))
    history += [one, HumanMessage("And one that is red?")]
    two = llm.invoke(history, thread("turns-1"))
    # Turn 2 reads turn 1's prompt and reply (bar the template's closing tokens) from KV.
    usage_one = one.usage_metadata or {}
    assert cache_read(one) >= made.prefix_len
    assert cache_read(two) >= usage_one.get("input_tokens", 0) > cache_read(one)
    sessions = [s.session_id for s in pools.get_pool("turns").sessions]
    assert sessions == ["turns-1"]  # one engine session, holding both turns
    assert pools.session("turns-1").ctx_used >= usage_one.get("total_tokens", 0)
    # Another thread is another session; an agent's scope another one within a thread.
    llm.invoke(ask("Hi.", "turns"), thread("turns-2"))
    model(smol, pool_id="turns", session_scope="critic").invoke(
        ask("Hi.", "turns"), thread("turns-1")
    )
    assert sorted(s.session_id or "" for s in pools.get_pool("turns").sessions) == [
        "turns-1", "turns-1/critic", "turns-2"
    ]  # fmt: skip


def test_streaming_and_async_carry_the_signals(smol: EngineProcess, pools: PolyKVClient) -> None:
    made = pools.create_pool(messages=sys_msgs("stream"), name="stream")
    llm = model(smol, pool_id="stream")
    chunks = list(llm.stream(ask("What is two plus two?", "stream"), thread("stream-1")))
    assert len(chunks) > 1
    first = polykv_signals(chunks[0])
    assert first is not None and first.pool_id == made.pool_id
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert cache_read(whole) >= made.prefix_len  # usage arrives on the last chunk

    async def go() -> tuple[AIMessage, list[Any]]:
        reply = await llm.ainvoke(ask("What is three plus three?", "stream"), thread("stream-2"))
        parts = [c async for c in llm.astream(ask("Name a colour.", "stream"), thread("stream-3"))]
        return reply, parts

    reply, parts = asyncio.run(go())
    assert cache_read(reply) >= made.prefix_len
    assert polykv_signals(reply) is not None and polykv_signals(parts[0]) is not None
    sessions = {s.session_id for s in pools.get_pool("stream").sessions}
    assert {"stream-1", "stream-2", "stream-3"} <= sessions


def test_engine_counts_the_tokens(smol: EngineProcess) -> None:
    llm = model(smol)
    n = llm.get_num_tokens_from_messages(ask("What is the capital of France?", "count"))
    reply = llm.invoke(ask("What is the capital of France?", "count"))
    assert n == (reply.usage_metadata or {}).get("input_tokens")


# --------------------------------------------------------------------------- admission


class Load:
    """One session decoding in ``pool`` until stopped (the pool's only active session)."""

    def __init__(self, eng: EngineProcess, pool: str, prompt: list[int]) -> None:
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.body = {"prompt": prompt, "n_predict": 200, "ignore_eos": True, "pool_id": pool,
                     "session_id": f"{pool}-load"}  # fmt: skip
        self.t = threading.Thread(target=self._run, args=(eng.base_url,))

    def _run(self, base: str) -> None:
        with httpx.Client(base_url=base, timeout=120) as c:
            while not self.stop.is_set():
                r = c.post("/completion", json=self.body)
                if r.status_code != 200:
                    self.errors.append(r.text)
                    return

    def __enter__(self) -> Load:
        self.t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.t.join()
        assert not self.errors, self.errors


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    # Generous: this waits for the engine's measurements on a small shared machine.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"not reached in {timeout:.0f}s: {what}")


@dataclass
class Full:
    pool: str  # enforced, a floor no CPU reaches, room guaranteed for two sessions
    old: str  # a thread that had its turn before the pool filled up


@pytest.fixture
def saturated(
    smol: EngineProcess, pools: PolyKVClient, request: pytest.FixtureRequest
) -> Iterator[Full]:
    """A full pool (its own per test, so no slot already caches its prefix): thread ``old``
    has had a turn, then a background session decodes and the pool refuses new sessions."""
    full = Full(pool=f"gated-{request.node.name[5:25]}".replace("_", "-"), old="")
    full.old = f"{full.pool}-old"
    pools.create_pool(messages=sys_msgs(full.pool), name=full.pool)
    pools.set_admission(
        full.pool,
        wire.AdmissionPolicy(target_tps_per_session=1e9, mode="enforced", settle_tokens=8,
                             settle_max_ms=1500, guarantee_min_sessions=2),
    )  # fmt: skip
    model(smol, pool_id=full.pool).invoke(ask("Hello.", full.pool), thread(full.old))
    count = [*sys_msgs(full.pool), {"role": "user", "content": "Count."}]
    with Load(smol, full.pool, pools.tokenize(pools.apply_template(count))):

        def refusing() -> bool:
            cap = pools.capacity(full.pool)
            return not cap.can_admit and cap.reason_code == "tps_floor"

        wait_for(refusing, f"pool {full.pool} refuses new sessions")
        yield full


def refusals(engine: EngineProcess) -> float:
    """The 429s the engine has answered on the chat route (its own request counter)."""
    text = httpx.get(engine.base_url + "/metrics", timeout=30).text
    want = ('route="/v1/chat/completions"', 'code="429"')
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("polykv_http_requests_total{") and all(w in line for w in want)
    )


def test_a_new_thread_is_refused_typed_an_existing_one_never(
    smol: EngineProcess, saturated: Full
) -> None:
    llm = model(smol, pool_id=saturated.pool)
    before = refusals(smol)
    with pytest.raises(PoolSaturated) as info:
        llm.invoke(ask("Hello?", saturated.pool), thread("new"))
    # Refused at once: the engine received the request once and refused it once; the SDK
    # did not retry it behind our back.
    assert refusals(smol) == before + 1
    assert info.value.reason == "tps_floor" and info.value.pool == saturated.pool
    assert info.value.retry_after is not None and info.value.retry_after >= 1
    assert isinstance(info.value.__cause__, openai.RateLimitError)
    with pytest.raises(PoolSaturated):  # streaming too
        list(llm.stream(ask("Hello?", saturated.pool), thread("new")))
    # The existing thread's next turn is a continuation: admitted while the pool is full.
    history = [*ask("Hello.", saturated.pool), AIMessage("Hi."), HumanMessage("How are you?")]
    reply = llm.invoke(history, thread(saturated.old))
    assert reply.content


def test_stock_chatopenai_needs_the_session_header(smol: EngineProcess, saturated: Full) -> None:
    """What a new user of the plain OpenAI client sees: without x-session-id each turn is a
    new session and the full pool refuses it; with the header it is a continuation."""
    stock = ChatOpenAI(base_url=f"{smol.base_url}/v1", api_key="none", model="m", max_tokens=16,
                       extra_body={"pool_id": saturated.pool}, max_retries=0,
                       use_responses_api=False)  # fmt: skip
    history = [*ask("Hello.", saturated.pool), AIMessage("Hi."), HumanMessage("How are you?")]
    with pytest.raises(openai.RateLimitError):
        stock.invoke(history)
    assert stock.invoke(history, extra_headers={"x-session-id": saturated.old}).content


def test_gate_interrupts_until_capacity_returns(
    smol: EngineProcess, pools: PolyKVClient, saturated: Full
) -> None:
    pool = saturated.pool
    llm = model(smol, pool_id=pool)

    def agent(state: PolyKVState) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(PolyKVState)
    graph.add_node("gate", CapacityGate(pools, "agent", pool=pool), destinations=("agent",))
    graph.add_node("agent", agent)
    graph.add_edge(START, "gate")
    app = graph.compile(checkpointer=InMemorySaver())
    cfg: Any = thread("waiting")

    out = app.invoke({"messages": ask("Hello?", pool)}, cfg)
    [paused] = out["__interrupt__"]
    assert paused.value["reason"] == "tps_floor" and paused.value["pool"] == pool
    out = app.invoke(Command(resume="retry"), cfg)  # still full: pauses again
    assert out["__interrupt__"] and len(out["messages"]) == 2
    # An existing thread passes the same gate at once: its session is a continuation.
    old = app.invoke({"messages": ask("Hello.", pool)}, thread(saturated.old))
    assert isinstance(old["messages"][-1], AIMessage) and old["capacity_ok"]

    pools.clear_admission(pool)  # the floor is lifted: capacity returns
    # The engine's published view catches up within a step; resume once it says so, as a
    # supervisor watching the pool would.
    wait_for(lambda: pools.capacity(pool).can_admit, f"pool {pool} admits again")
    out = app.invoke(Command(resume="retry"), cfg)
    assert "__interrupt__" not in out
    assert isinstance(out["messages"][-1], AIMessage) and out["capacity_ok"] is True
    assert out["headroom_sessions"] >= 1 and out["mean_active_tps"] >= 0
    assert "waiting" in {s.session_id for s in pools.get_pool(pool).sessions}
