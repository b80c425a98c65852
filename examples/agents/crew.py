"""A planner and its workers on one PolyKV pool tree, as a LangGraph graph.

    python examples/agents/crew.py --start                 # starts a local engine (SmolLM2)
    python examples/agents/crew.py --engine URL --admin-key KEY

The walk-through is in docs/langgraph.md. In short:

    crew (root: shared rules)            the pool tree this script makes
    ├── planner  (+ planner role)        the planner's thread attaches here
    │   └── planner-c-…                  made by compaction: planner + summary
    └── workers  (+ worker role, tools)  every worker session attaches here

    START -> compact -> plan -> gate -> spawn -> worker × n -> collect -> review -> compact …
                                 ^                             |
                                 +------- more steps left -----+

``gate`` asks the engine whether one more worker session fits the workers pool (its tps floor,
KV and context headroom) and pauses the graph (``interrupt``) while it does not; this script
resumes it after the wait the engine advised. ``compact`` re-forks the planner's pool with a
summary when the planner's context runs low. Every model call is keyed on the thread
(``x-session-id``), so a worker's or the planner's next turn continues its engine session.
"""

from __future__ import annotations

import argparse
import hashlib
import operator
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send
from pydantic import Field

from polykv_api import models as wire
from polykv_client import PolyKVClient
from polykv_langgraph import (
    CapacityGate,
    CompactionNode,
    PolyKVChatModel,
    PolyKVState,
    PoolTree,
    polykv_signals,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"

CREW = [{"role": "system", "content": "You are part of a small software crew. Be brief."}]
PLANNER = [{"role": "system", "content": "You are the planner. You split a task into steps."}]
WORKER = [{"role": "system", "content": "You are a worker. You carry out one step."}]


# Bounded: a grammar-enforcing engine then ends the string even when a small model would
# loop inside it, so the call fits in CALL_TOKENS and always parses.
Step = Annotated[str, Field(max_length=80, description="the step, as the planner wrote it")]
CALL_TOKENS = 160  # the call's JSON around an 80-character step, one token a character


@tool
def estimate_hours(step: Step) -> int:
    """Estimate how many hours a step of work takes."""
    return 1 + int(hashlib.sha256(step.encode()).hexdigest(), 16) % 8


class Crew(PolyKVState, total=False):
    task: str
    steps: list[str]
    pending: list[str]
    results: Annotated[list[str], operator.add]
    round: int
    spawned: int


def say(text: str) -> None:
    print(f"[crew] {text}", flush=True)


def build(client: PolyKVClient, base_url: str, args: argparse.Namespace) -> Any:
    tree = PoolTree(client)
    tree.root("crew", CREW)
    tree.fork("crew", "planner", PLANNER)
    tree.fork("crew", "workers", WORKER, tools=[convert_to_openai_tool(estimate_hours)])
    if args.floor is not None:
        policy = wire.AdmissionPolicy(target_tps_per_session=args.floor, mode="enforced")
        client.set_admission("workers", policy)

    llm = PolyKVChatModel(base_url=base_url, temperature=0, max_tokens=args.max_tokens)
    planner = llm.bind(session_scope="planner")
    compact = CompactionNode(
        llm,
        tree,
        "planner",
        threshold=args.compact_at,
        min_headroom=args.compact_below,
        keep=2,
        session_scope="planner",
    )

    def plan(state: Crew) -> dict[str, Any]:
        ask = HumanMessage(
            f"Task: {state['task']}. List {args.workers} short steps, one per line."
            if not state.get("round")
            else f"Results so far: {' | '.join(state['results'][-args.workers :])}. "
            f"List {args.workers} short follow-up steps, one per line."
        )
        reply = planner.invoke([*state["messages"], ask], pool_id=state["pool_id"])
        steps = _steps(str(reply.content), args.workers)
        say(f"round {state.get('round', 0) + 1}: planner on pool {state['pool_id']}: {steps}")
        return {"messages": [ask, reply], "steps": steps, "pending": steps}

    def spawn(state: Crew) -> Command[Any]:
        room = max(1, int(state.get("headroom_sessions") or 1))
        now, rest = state["pending"][:room], state["pending"][room:]
        first = state.get("spawned", 0)
        say(f"gate: {room} more worker session(s) fit; spawning {len(now)}")
        sends = [
            Send("worker", {"step": s, "worker": (first + i) % args.workers})
            for i, s in enumerate(now)
        ]
        return Command(update={"pending": rest, "spawned": first + len(now)}, goto=sends)

    def worker(job: dict[str, Any]) -> dict[str, Any]:
        # Tools first, then the worker's pool and session: `bind_tools` on a binding binds the
        # model underneath and drops the binding's own keys (both workers would then share
        # the thread's session, and the engine refuses a second turn running in one session).
        mine = {"pool_id": "workers", "session_scope": f"worker-{job['worker']}"}
        msgs: list[Any] = [
            SystemMessage(CREW[0]["content"]),
            SystemMessage(WORKER[0]["content"]),
            HumanMessage(f"Step: {job['step']}. Estimate it with the tool."),
        ]
        call = llm.bind_tools(
            [estimate_hours], tool_choice="required", parallel_tool_calls=False
        ).bind(**mine)
        asked = call.invoke(msgs, max_tokens=CALL_TOKENS)
        msgs.append(asked)
        for tc in asked.tool_calls:
            msgs.append(ToolMessage(str(estimate_hours.invoke(tc["args"])), tool_call_id=tc["id"]))
        for bad in asked.invalid_tool_calls:  # every call gets an answer, even a broken one
            msgs.append(ToolMessage(f"error: {bad['error']}", tool_call_id=bad["id"] or ""))
        done = llm.bind_tools([estimate_hours], tool_choice="none").bind(**mine).invoke(msgs)
        sig = polykv_signals(done)
        reuse = (done.usage_metadata or {}).get("input_token_details", {}).get("cache_read", 0)
        say(
            f"worker-{job['worker']}: {str(done.content)[:60]!r} "
            f"(reused {reuse} prompt tokens, {sig.session_tps if sig else '?'} tok/s)"
        )
        return {"results": [f"{job['step']}: {done.content}"]}

    def collect(state: Crew) -> Command[Any]:
        return Command(goto="gate" if state.get("pending") else "review")

    def review(state: Crew) -> Command[Any]:
        ask = HumanMessage("Summarize the results in one sentence.")
        reply = planner.invoke([*state["messages"], ask], pool_id=state["pool_id"])
        rnd = state.get("round", 0) + 1
        sig = polykv_signals(reply)
        say(f"review {rnd}: {str(reply.content)[:80]!r}")
        if sig is not None:
            say(f"planner context headroom {sig.ctx_headroom}, pressure {sig.compaction_pressure}")
        goto = "compact" if rnd < args.rounds else END
        return Command(update={"messages": [ask, reply], "round": rnd}, goto=goto)

    graph = StateGraph(Crew)
    graph.add_node("compact", compact)
    graph.add_node("plan", plan)
    graph.add_node("gate", CapacityGate(client, "spawn", pool="workers"), destinations=("spawn",))
    graph.add_node("spawn", spawn, destinations=("worker",))
    graph.add_node("worker", worker)
    graph.add_node("collect", collect, destinations=("gate", "review"))
    graph.add_node("review", review, destinations=("compact", END))
    graph.add_edge(START, "compact")
    graph.add_edge("compact", "plan")
    graph.add_edge("plan", "gate")
    graph.add_edge("worker", "collect")
    return graph.compile(checkpointer=InMemorySaver()), tree


def _steps(text: str, n: int) -> list[str]:
    lines = [re.sub(r"^[\s\-*\d.)]+", "", ln).strip() for ln in text.splitlines()]
    steps = [ln[:80] for ln in lines if len(ln) > 3][:n]
    return steps + [f"step {i + 1} of the task" for i in range(len(steps), n)]


def run(base_url: str, admin_key: str | None, args: argparse.Namespace) -> dict[str, Any]:
    with PolyKVClient(base_url, admin_key=admin_key) as client:
        app, tree = build(client, base_url, args)
        cfg: Any = {"configurable": {"thread_id": args.thread}}
        start = [SystemMessage(m["content"]) for m in tree.prefix("planner").messages]
        out = app.invoke({"messages": start, "pool_id": "planner", "task": args.task}, cfg)
        waited = 0.0
        while "__interrupt__" in out:
            why = out["__interrupt__"][0].value
            pause = float(why.get("retry_after_s") or 1)
            say(f"gate: workers pool full ({why['reason']}); waiting {pause:.0f}s")
            if waited >= args.max_wait:
                raise SystemExit(f"the workers pool stayed full for {waited:.0f}s")
            time.sleep(pause)
            waited += pause
            out = app.invoke(Command(resume="retry"), cfg)
        listing = client.list_pools()
        say("pool tree: " + ", ".join(f"{p.path} ({p.prefix_len} tokens)" for p in listing.pools))
        say(
            f"done: {out.get('round')} round(s), {len(out.get('results', []))} worker results, "
            f"{out.get('compactions', 0)} compaction(s)"
        )
        if not args.keep_pools:
            tree.release("crew")
        return dict(out)


def start_engine(port: int) -> subprocess.Popen[bytes]:
    cmd = [
        str(Path(sys.executable).parent / "polykv-engine"),
        "-m",
        str(MODEL),
        "-np",
        "4",
        "-c",
        "4096",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the engine exited with {proc.returncode}")
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the engine did not become healthy in 180 s")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", help="engine URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--start", action="store_true", help="start a local engine on SmolLM2")
    p.add_argument("--port", type=int, default=8088, help="port for --start")
    p.add_argument("--admin-key", default=os.environ.get("POLYKV_ADMIN_KEY"))
    p.add_argument("--task", default="ship a small web service that stores notes")
    p.add_argument("--workers", type=int, default=3, help="steps (and worker sessions) a round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--floor",
        type=float,
        default=1.0,
        help="tokens/s per session the workers pool enforces (omit: 0 = none)",
    )
    p.add_argument("--compact-at", type=float, default=0.8, help="compaction pressure 0..1")
    p.add_argument(
        "--compact-below",
        type=int,
        default=None,
        help="also compact when the planner's context headroom is this low",
    )
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-wait", type=float, default=120.0)
    p.add_argument("--thread", default="crew-1")
    p.add_argument("--keep-pools", action="store_true")
    args = p.parse_args(argv)
    if args.floor == 0:
        args.floor = None
    if not args.engine and not args.start:
        p.error("give --engine URL or --start")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    proc = start_engine(args.port) if args.start else None
    try:
        run(args.engine or f"http://127.0.0.1:{args.port}", args.admin_key, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
