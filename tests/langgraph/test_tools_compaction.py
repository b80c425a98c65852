"""Pool tools called by a real agent change the engine's tree; compaction by re-fork moves a
thread to a new pool and leaves nothing behind (SmolLM2-135M-Instruct, real engine)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from pydantic import ValidationError

from polykv_client import PolyKVClient
from polykv_engine.testing import EngineProcess
from polykv_langgraph import (
    CompactionNode,
    PolyKVChatModel,
    PolyKVState,
    PoolTree,
    polykv_signals,
    pool_tools,
)
from polykv_langgraph.tools import NAME_PATTERN

from .conftest import clean

pytestmark = pytest.mark.real_model

CREW = [{"role": "system", "content": "You manage a crew of agents and their shared pools."}]


def test_an_agent_forks_a_pool_through_toolnode(smol: EngineProcess, pools: PolyKVClient) -> None:
    tree = PoolTree(pools)
    tree.root("crew", CREW)
    # Bounded arguments: a name of at most 63 characters and 200 of instructions, so the
    # whole call fits in max_tokens even at one token a character (SmolLM2 sometimes loops
    # inside a string; the grammar then closes it instead of max_tokens cutting the call).
    tools = pool_tools(tree, pools=["crew"], max_instructions=200)
    llm = PolyKVChatModel(base_url=smol.base_url, temperature=0, max_tokens=384, pool_id="crew")
    caller = llm.bind_tools(tools, tool_choice="fork_pool", parallel_tool_calls=False)

    def agent(state: PolyKVState) -> dict[str, Any]:
        return {"messages": [caller.invoke(state["messages"])]}

    graph = StateGraph(PolyKVState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_edge("agent", "tools")
    graph.add_edge("tools", END)
    app = graph.compile()
    ask = "Fork the crew pool into a new pool named reviewers for agents who review code."
    out = app.invoke(
        {"messages": [SystemMessage(CREW[0]["content"]), HumanMessage(ask)]},
        {"configurable": {"thread_id": "tools-1"}},
    )
    call = next(m for m in out["messages"] if isinstance(m, AIMessage)).tool_calls[0]
    assert call["name"] == "fork_pool" and call["args"]["parent"] == "crew"
    result = out["messages"][-1]
    assert isinstance(result, ToolMessage) and '"created"' in str(result.content)
    child = call["args"]["name"]
    crew = pools.get_pool("crew")
    assert [d.name for d in crew.descendants] == [child]  # the engine's tree changed
    assert crew.descendants[0].branch_pos == crew.prefix_len  # an extension of the parent
    assert child in tree.prefixes and tree.prefixes[child].parent == "crew"
    # The status tool reads the tree back; a refusal comes back as text, not an exception.
    by_name = {t.name: t for t in tools}
    assert child in by_name["pool_status"].invoke({"pool": "crew"})
    again = by_name["create_pool"].invoke({"name": "crew", "instructions": "Other words."})
    assert '"error": "name_conflict"' in again


def test_pool_tool_arguments_are_bounded_for_the_grammar(pools: PolyKVClient) -> None:
    by_name = {t.name: t for t in pool_tools(PoolTree(pools), max_instructions=120)}
    params = convert_to_openai_tool(by_name["fork_pool"])["function"]["parameters"]
    assert params["properties"]["instructions"]["maxLength"] == 120
    assert params["properties"]["name"]["pattern"] == NAME_PATTERN
    # The same bounds refuse a call before it reaches the engine (ToolNode tells the model).
    with pytest.raises(ValidationError, match="pattern"):
        by_name["create_pool"].invoke({"name": "Not a name", "instructions": "x"})
    with pytest.raises(ValidationError, match="pattern"):  # all digits: the engine's ids
        by_name["create_pool"].invoke({"name": "123", "instructions": "x"})
    with pytest.raises(ValidationError, match="at most 120"):
        by_name["create_pool"].invoke({"name": "ok", "instructions": "x" * 121})
    assert pools.list_pools().pools == []  # nothing was made


def test_a_model_chosen_pool_name_is_a_tool_error_not_a_request(
    smol: EngineProcess, pools: PolyKVClient
) -> None:
    """Unrestricted pool arguments (no ``pools`` list) are checked with the engine's rule
    before any call: a name that would resolve to another route is a tool error."""
    evil = "../../slots/0?action=erase#"
    by_name = {t.name: t for t in pool_tools(PoolTree(pools))}
    before = httpx.get(smol.base_url + "/metrics", timeout=30).text
    calls = {
        "pool_status": {"pool": evil},
        "capacity": {"pool": evil},
        "fork_pool": {"parent": evil, "name": "child", "instructions": "x"},
    }
    for tool, args in calls.items():
        out = json.loads(by_name[tool].invoke(args))
        assert out["error"] == "name_invalid", (tool, out)
    after = httpx.get(smol.base_url + "/metrics", timeout=30).text

    def engine_seen(text: str) -> float:
        return sum(
            float(ln.rpartition(" ")[2])
            for ln in text.splitlines()
            if ln.startswith("polykv_http_requests_total{") and 'route="/metrics"' not in ln
        )

    assert engine_seen(after) == engine_seen(before)  # not one request reached the engine


@pytest.fixture(scope="module")
def small_ctx(start_smol: Callable[..., EngineProcess]) -> EngineProcess:
    """Two slots sharing 2048 cells: a long conversation drives compaction pressure up."""
    return start_smol("-np", "2", "-c", "2048")


FILLER = (
    "Here is more background for the report: the crew reviewed the logs, the build, the "
    "tests and the deployment notes, and found nothing new to add about the system. "
) * 6


@pytest.mark.slow  # about 90 s on 2 cores: a dozen long turns fill the context
def test_compaction_reforks_and_leaves_nothing_behind(small_ctx: EngineProcess) -> None:
    c = PolyKVClient(small_ctx.base_url)
    clean(c)
    tree = PoolTree(c)
    system = [{"role": "system", "content": "You are a concise assistant for a release crew."}]
    base = tree.root("crew", system)
    llm = PolyKVChatModel(base_url=small_ctx.base_url, temperature=0, max_tokens=24)
    compact = CompactionNode(llm, tree, "crew", threshold=0.2, keep=2, summary_tokens=48)

    def agent(state: PolyKVState) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"], pool_id=state["pool_id"])]}

    graph = StateGraph(PolyKVState)
    graph.add_node("compact", compact)
    graph.add_node("agent", agent)
    graph.add_edge(START, "compact")
    graph.add_edge("compact", "agent")
    graph.add_edge("agent", END)
    app = graph.compile(checkpointer=InMemorySaver())
    cfg: Any = {"configurable": {"thread_id": "long"}}

    state = app.invoke({"messages": [SystemMessage(system[0]["content"])], "pool_id": "crew"}, cfg)
    turns = 0
    while not compact.due(state):
        turns += 1
        assert turns <= 12, f"pressure never reached 0.2: {polykv_signals(state['messages'][-1])}"
        state = app.invoke({"messages": [HumanMessage(f"Note {turns}. {FILLER}")]}, cfg)
    pressure = polykv_signals(state["messages"][-1])
    assert pressure is not None and (pressure.compaction_pressure or 0) >= 0.2
    assert state["pool_id"] == "crew" and not state.get("compactions")

    state = app.invoke({"messages": [HumanMessage("What should we do next?")]}, cfg)
    new_pool = state["pool_id"]
    assert state["compactions"] == 1 and new_pool.startswith("crew-c-")
    reply = state["messages"][-1]
    made = c.get_pool(new_pool)
    assert made.parent_name == "crew" and made.branch_pos == base.prefix_len  # re-forked
    usage = reply.usage_metadata or {}
    # The turn after compaction reads the whole new prefix (system + summary) from the pool.
    assert usage["input_token_details"]["cache_read"] >= made.prefix_len
    assert usage["input_tokens"] < 600  # the conversation is short again
    assert [s.session_id for s in made.sessions] == ["long"]  # the thread moved over

    # Drive it over again: the second compaction releases the first one's pool.
    while not compact.due(state):
        turns += 1
        assert turns <= 24, "pressure never came back"
        state = app.invoke({"messages": [HumanMessage(f"Note {turns}. {FILLER}")]}, cfg)
    state = app.invoke({"messages": [HumanMessage("And now?")]}, cfg)
    assert state["compactions"] == 2 and state["pool_id"] != new_pool
    listing = c.list_pools()
    assert sorted(p.name or "" for p in listing.pools) == sorted(["crew", state["pool_id"]])
    assert not any(p.orphaned_pin for p in listing.pools)  # no pin left behind
    assert not any(p.pinned_explicit for p in listing.pools)
    clean(c)
    c.close()
