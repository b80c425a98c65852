"""A crew of agents end to end: a planner and 8 workers over several rounds, with tool calls,
tool results and compaction, driven by one client (the OpenAI SDK) against upstream
llama-server and against PolyKV, side by side in one run.

The crew (``examples/agents/crew.py`` scaled up): every agent shares one system prompt (the
crew's rules, its tools and the project's notes). Each round the planner writes the round's
steps; then the 8 workers run at once, each: a tool call (JSON constrained by a schema:
``{"tool", "argument"}``), the tool's run (a fixed pause), its fixed result sent back, and an
answer. A session whose context has grown more than ``compact_budget`` tokens past its first
prompt first has its history summarised (a summary turn; the history is then the summary).
The next round's planner prompt carries the workers' answers.

Tool calls are made by a JSON schema, not by OpenAI ``tools``: SmolLM2's and Gemma 3's chat
templates have no tool syntax, llama-server then leaves the tools out of the prompt, and with a
tool-aware template its ``tool_choice: required`` still lets a model write text first (a 135M
model then never calls); a schema makes both servers produce the call the same way. Tool
results go back as user messages (Gemma's template admits no other role there).

Content is deterministic: greedy decoding, fixed steps, tool results and pauses; plain-text
turns ignore EOS, so their lengths are fixed. The two servers get the same requests:

* **llama-server**: upstream, built from the llama.cpp tree the engine's wheel is built from
  (``bench/build_llama_server.sh``), no pools, its defaults (prompt cache, slot selection by
  similarity);
* **PolyKV**: the shared system prompt a pool (its tokens: the longest common prefix of two
  rendered conversations, so any template works), every agent attached by ``pool_id`` and
  keyed by ``x-session-id``, the pool's floor enforced (``POST /polykv/pools/crew/admission``
  ``{target_tps_per_session, mode: enforced, on_saturation: queue}``): a new session is held
  until there is room for it, and prompts are paced so sessions decoding keep the floor. The
  pool's build is inside the wall time.

Both: ``-np 9 -c C -t T -fa on``. Each repetition starts both servers fresh and runs the crew
on each in turn (the order alternating; the one not measured is stopped with SIGSTOP). Per run:
wall time; each session's time under the floor (seconds in inter-token gaps longer than the
floor period, see ``bench.agent_timeline``); the largest inter-token gap; first-token time per
turn; KV cells in use (peak over the rounds; llama-server: the tokens its slots hold).

    python -m bench.agent_crew [--reps 2] [--rounds 4] [--model gemma-3-270m-q4_k_m] [--quick]
    python -m bench.agent_crew --from-json bench/results/agent_crew.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from . import charts
from . import harness as H
from . import report as R
from .agent_timeline import TurnTimes, mean_tps_series, needs_compaction, under_floor_by_session
from .engine_client import Api
from .upstream import llama_server_env, llama_server_or_skip, model_path
from .workload import word_text

NAME = "agent_crew"
SERVERS = ("llama_server", "polykv")
LABELS = {"llama_server": "llama-server", "polykv": "PolyKV, pool + floor"}
POOL = "crew"
SEED = 7
SERIES_STEP_S = 0.5  # the chart's sampling of the mean rate
TOOLS = ("read_file", "run_tests", "search_code")
TASK = "add rate limiting to the notes service and document it"
SYSTEM_HEAD = (
    "You are one agent of a software crew: a planner splits the work into steps and workers "
    "carry them out. Be brief and concrete. To use a tool, reply with a JSON object "
    '{"tool": <name>, "argument": <text>}. The tools:\n'
    "- read_file: the text of a file of the repository (argument: its path)\n"
    "- run_tests: the test report of a module (argument: the module)\n"
    "- search_code: where a name is used (argument: the name)\n"
    "A tool's result comes back in the next message. The project's notes follow.\n"
)
CALL_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "tool_call",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "tool": {"enum": list(TOOLS)},
                "argument": {"type": "string", "maxLength": 24},
            },
            "required": ["tool", "argument"],
            "additionalProperties": False,
        },
    },
}
VERBS = ("check", "extend", "test", "document", "refactor", "profile", "review", "fix")
PARTS = ("limiter", "notes API", "storage", "config", "metrics", "auth", "docs", "CLI")


@dataclass
class Config:
    reps: int = 2
    model: str = "smollm2-135m-instruct-q4_1"
    workers: int = 8
    rounds: int = 4
    floor_tps: float = 5.0
    notes_words: int = 800  # the project notes in the shared system prompt
    tool_words: tuple[int, int] = (60, 160)  # a tool result's length, drawn per (round, worker)
    tool_pause_s: tuple[float, float] = (0.2, 1.0)  # a tool's run, drawn per (round, worker)
    plan_tokens: int = 32
    call_tokens: int = 40
    answer_tokens: int = 24
    summary_tokens: int = 40
    compact_budget: int = 500  # tokens past the first prompt before a history is summarised
    slot_ctx: int = 3072  # per agent; -c is this times the slots
    threads: int = 2
    flash_attn: str = "on"
    servers: tuple[str, ...] = SERVERS

    @property
    def slots(self) -> int:
        return self.workers + 1


# ---------------------------------------------------------------------------- content


def system_prompt(cfg: Config) -> str:
    return SYSTEM_HEAD + word_text("crew-notes", cfg.notes_words).capitalize() + "."


def step_text(r: int, i: int) -> str:
    rng = random.Random(f"step/{r}/{i}")
    return (
        f"Round {r + 1}, step {i + 1}: {rng.choice(VERBS)} the {rng.choice(PARTS)} part of the "
        f"task ({TASK}). Call one tool."
    )


def tool_result(cfg: Config, r: int, i: int, tool: str) -> str:
    n = random.Random(f"tool/{r}/{i}").randint(*cfg.tool_words)
    return f"Result of {tool}: exit 0\n{word_text(f'tool/{r}/{i}', n)}"


def tool_pause(cfg: Config, r: int, i: int) -> float:
    return random.Random(f"pause/{r}/{i}").uniform(*cfg.tool_pause_s)


def planner_ask(cfg: Config, r: int, answers: Sequence[str]) -> str:
    done = " | ".join(a.strip().replace("\n", " ")[:80] for a in answers)
    ask = f"Round {r + 1} of the task: {TASK}."
    if done:
        ask += f" The workers' answers last round: {done}."
    return ask + f" Write the {cfg.workers} steps of this round, one a line."


def called_tool(text: str) -> str:
    """The tool a call names (the first listed when it names none: a call cut short)."""
    with contextlib.suppress(ValueError, AttributeError):
        tool = json.loads(text).get("tool")
        if tool in TOOLS:
            return str(tool)
    found = re.search("|".join(TOOLS), text)
    return found.group(0) if found else TOOLS[0]


# ---------------------------------------------------------------------------- one crew run


@dataclass
class Target:
    key: str
    base_url: str
    pid: int
    pool: str | None  # the pool every agent attaches to (PolyKV)
    kv_cells: Callable[[], int]


@dataclass
class Session:
    """One agent's conversation as its client keeps it (after the shared system prompt)."""

    name: str
    history: list[dict[str, str]] = field(default_factory=list)
    first_prompt: int | None = None  # prompt tokens of its first turn
    context: int = 0  # prompt + completion tokens of its last turn
    compactions: int = 0


@dataclass
class Crew:
    """The client side of one run on one server: the same code for every server."""

    cfg: Config
    target: Target
    system: str
    client: openai.OpenAI
    t0: float = 0.0
    turns: list[dict[str, Any]] = field(default_factory=list)
    times: list[TurnTimes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def turn(
        self, s: Session, kind: str, r: int, ask: str, max_tokens: int, call: bool = False
    ) -> str:
        """One streamed chat turn of session ``s``; ``ask`` joins its history, then the reply."""
        s.history.append({"role": "user", "content": ask})
        extra: dict[str, Any] = {"ignore_eos": not call}  # plain text: a fixed length
        if self.target.pool is not None:
            extra["pool_id"] = self.target.pool
        kwargs: dict[str, Any] = {
            "model": "crew",
            "messages": [{"role": "system", "content": self.system}, *s.history],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": SEED,
            "stream": True,
            "stream_options": {"include_usage": True},
            "extra_headers": {"x-session-id": s.name},
            "extra_body": extra,
        }
        if call:
            kwargs["response_format"] = CALL_FORMAT
        sent = time.perf_counter()
        refused = 0
        while True:
            try:
                stream = self.client.chat.completions.create(**kwargs)
                break
            except openai.RateLimitError as exc:  # the floor's gate: wait as told, then again
                refused += 1
                time.sleep(float(exc.response.headers.get("retry-after") or 1.0))
        text, arrivals, usage = "", [], None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    text += choice.delta.content
                    arrivals.append(time.perf_counter() - self.t0)
        if not arrivals or usage is None:
            raise H.BenchError(f"{self.target.key}: {s.name} {kind}: no token or no usage")
        s.history.append({"role": "assistant", "content": text})
        s.context = usage.prompt_tokens + usage.completion_tokens
        if s.first_prompt is None:
            s.first_prompt = usage.prompt_tokens
        details = usage.prompt_tokens_details
        times = TurnTimes(s.name, sent - self.t0, tuple(arrivals))
        record = {
            "session": s.name, "kind": kind, "round": r, "refused": refused,
            "first_token_s": times.first_token_s, "chunks": len(arrivals),
            "largest_gap_s": times.largest_gap_s(),
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": int(details.cached_tokens or 0) if details is not None else 0,
        }  # fmt: skip
        with self.lock:
            self.turns.append(record)
            self.times.append(times)
        return text

    def compact_if_due(self, s: Session, r: int) -> None:
        if s.first_prompt is None or not needs_compaction(
            s.context, s.first_prompt, self.cfg.compact_budget
        ):
            return
        ask = "Summarise your work so far in two sentences, for your own notes."
        summary = self.turn(s, "summary", r, ask, self.cfg.summary_tokens)
        s.history = [
            {"role": "user", "content": f"Your notes on the earlier rounds: {summary}"},
            {"role": "assistant", "content": "Noted."},
        ]
        s.compactions += 1

    def worker_round(self, s: Session, r: int, i: int) -> str:
        self.compact_if_due(s, r)
        call = self.turn(s, "call", r, step_text(r, i), self.cfg.call_tokens, call=True)
        tool = called_tool(call)
        time.sleep(tool_pause(self.cfg, r, i))  # the tool runs
        result = tool_result(self.cfg, r, i, tool)
        return self.turn(s, "answer", r, result, self.cfg.answer_tokens)

    def run(self, setup: Callable[[], None]) -> dict[str, Any]:
        cfg = self.cfg
        planner = Session("planner")
        workers = [Session(f"worker-{i}") for i in range(cfg.workers)]
        kv: list[int] = []
        answers: list[str] = []
        self.t0 = time.perf_counter()
        setup()  # PolyKV: the pool built and its floor set, inside the wall time
        with ThreadPoolExecutor(max_workers=cfg.workers) as pool:
            for r in range(cfg.rounds):
                self.compact_if_due(planner, r)
                self.turn(planner, "plan", r, planner_ask(cfg, r, answers), cfg.plan_tokens)
                futures = [pool.submit(self.worker_round, w, r, i) for i, w in enumerate(workers)]
                answers = [f.result() for f in futures]
                kv.append(self.target.kv_cells())
                H.progress(
                    f"  {LABELS[self.target.key]}: round {r + 1}/{cfg.rounds} done at "
                    f"{time.perf_counter() - self.t0:.1f} s, {len(self.turns)} turns, "
                    f"{sum(t['refused'] for t in self.turns)} refusals waited out"
                )
        wall = time.perf_counter() - self.t0
        under = under_floor_by_session(self.times, cfg.floor_tps)
        sessions = [planner, *workers]
        return {
            "wall_s": wall,
            "under_floor_s": {s.name: under.get(s.name, 0.0) for s in sessions},
            "kv_cells": kv,
            "compactions": {s.name: s.compactions for s in sessions},
            "series": mean_tps_series(self.times, wall, SERIES_STEP_S),
            "turns": self.turns,
        }


# ---------------------------------------------------------------------------- servers


def pool_tokens(api: Api, system: str) -> list[int]:
    """The shared system prompt's tokens as the chat route renders it: the longest common
    prefix of two conversations that differ from their first user word on."""
    rendered = []
    for ask in ("Alpha.", "Zulu?"):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
        prompt = api.post("/apply-template", {"messages": msgs})["prompt"]
        rendered.append(api.tokenize(prompt, add_special=True))
    a, b = rendered
    n = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:n]


def warm_up(client: httpx.Client, base_url: str) -> None:
    """One tiny chat request before anything is timed (nothing in common with the crew's)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    client.post(f"{base_url}/v1/chat/completions", json=body).raise_for_status()


@contextlib.contextmanager
def servers(cfg: Config, binary: str | None, model: Path) -> Iterator[dict[str, Target]]:
    """Both servers, fresh, for one repetition."""
    common = ["-np", str(cfg.slots), "-c", str(cfg.slots * cfg.slot_ctx), "-t", str(cfg.threads),
              "-fa", cfg.flash_attn]  # fmt: skip
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(H.http_client())
        out: dict[str, Target] = {}
        if "polykv" in cfg.servers:
            eng = stack.enter_context(
                H.engine("polykv-crew", model, [*common, "--polykv-stream-interval-ms", "0"])
            )
            assert eng.proc is not None
            api = Api(client, eng.base_url, eng.proc.pid)
            warm_up(client, eng.base_url)

            def cells() -> int:
                return int(api.pools()["kv_cells_used"])

            out["polykv"] = Target("polykv", eng.base_url, eng.proc.pid, POOL, cells)
        if binary is not None:
            argv = [binary, "-m", str(model), *common, "--host", "127.0.0.1", "--port", "{port}",
                    "--no-webui"]  # fmt: skip
            ls = H.ServerProcess("llama-server-crew", argv, "/health", env=llama_server_env(binary))
            stack.enter_context(H.server(ls))
            warm_up(client, ls.base_url)

            def slot_tokens(url: str = ls.base_url) -> int:  # its slots share no cells
                slots = client.get(f"{url}/slots").json()
                return sum(int(s.get("n_prompt_tokens", 0)) for s in slots)

            out["llama_server"] = Target("llama_server", ls.base_url, ls.pid, None, slot_tokens)
        yield out


def setup_for(cfg: Config, target: Target, system: str) -> Callable[[], None]:
    """What a run does before its first turn: PolyKV builds the pool and sets its floor."""
    if target.pool is None:
        return lambda: None

    def build() -> None:
        with H.http_client() as client:
            api = Api(client, target.base_url, target.pid)
            api.create_pool(POOL, pool_tokens(api, system))
            api.post(
                f"/polykv/pools/{POOL}/admission",
                {
                    "target_tps_per_session": cfg.floor_tps,
                    "mode": "enforced",
                    "on_saturation": "queue",
                },
            )

    return build


def one_run(cfg: Config, target: Target) -> dict[str, Any]:
    system = system_prompt(cfg)
    client = openai.OpenAI(
        base_url=f"{target.base_url}/v1", api_key="none", max_retries=0, timeout=600.0
    )
    try:
        crew = Crew(cfg, target, system, client)
        with H.CpuWatch([target.pid]) as cpu:
            run = crew.run(setup_for(cfg, target, system))
    finally:
        client.close()
    return {**run, "foreign_cpu_cores": cpu.foreign_cores}


def measure(cfg: Config, binary: str | None) -> dict[str, Any]:
    raw: dict[str, Any] = {"env": R.environment(), "runs": []}
    model = model_path(cfg.model)
    raw["model_digest"] = H.file_digest(model)
    for rep in range(cfg.reps):
        with servers(cfg, binary, model) as tgts:
            keys = [k for k in SERVERS if k in tgts]
            order = keys if rep % 2 == 0 else keys[::-1]
            for key in order:
                with H.paused([t.pid for k, t in tgts.items() if k != key]):
                    run = one_run(cfg, tgts[key])
                under = run["under_floor_s"]
                H.progress(
                    f"rep {rep + 1}/{cfg.reps} {LABELS[key]:<21} wall {run['wall_s']:6.1f} s, "
                    f"under the floor {sum(under.values()):6.1f} s (worst session "
                    f"{max(under.values()):.1f} s), largest gap "
                    f"{max(t['largest_gap_s'] for t in run['turns']):.2f} s, KV cells "
                    f"{max(run['kv_cells'])}, other load {run['foreign_cpu_cores']:.2f} cores"
                )
                raw["runs"].append({"rep": rep, "server": key, **run})
    return raw


# ---------------------------------------------------------------------------- analysis


def run_figures(run: Mapping[str, Any]) -> dict[str, float]:
    """One run's headline figures."""
    turns = run["turns"]
    under = run["under_floor_s"].values()
    first = [t["first_token_s"] for t in turns]
    return {
        "wall_s": run["wall_s"],
        "under_floor_total_s": sum(under),
        "under_floor_worst_s": max(under),
        "largest_gap_s": max(t["largest_gap_s"] for t in turns),
        "first_token_median_s": statistics.median(first),
        "first_token_max_s": max(first),
        "kv_cells_peak": max(run["kv_cells"]),
        "completion_tokens": sum(t["completion_tokens"] for t in turns),
        "prompt_tokens_computed": sum(t["prompt_tokens"] - t["cached_tokens"] for t in turns),
        "refused": sum(t["refused"] for t in turns),
        "compactions": sum(run["compactions"].values()),
    }


RATIOS = ("wall_s", "under_floor_total_s", "largest_gap_s", "first_token_median_s",
          "kv_cells_peak")  # fmt: skip


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    per: dict[str, dict[int, dict[str, float]]] = {}
    for run in raw["runs"]:
        per.setdefault(run["server"], {})[run["rep"]] = run_figures(run)
    out: dict[str, Any] = {}
    for key, reps in per.items():
        names = next(iter(reps.values()))
        out[key] = {n: H.summarize([f[n] for f in reps.values()]).as_dict() for n in names}
    ls, pk = per.get("llama_server", {}), per.get("polykv", {})
    paired = [rep for rep in pk if rep in ls]
    ratios: dict[str, Any] = {}
    for n in RATIOS:
        vals = [ls[rep][n] / pk[rep][n] for rep in paired if pk[rep][n] > 0]
        if vals:
            ratios[n] = H.summarize(vals).as_dict()
    out["llama_server_over_polykv"] = ratios
    return out


def _series_run(raw: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    """The run of ``key`` whose wall time is its median: the one a chart shows."""
    mine = sorted((r for r in raw["runs"] if r["server"] == key), key=lambda r: r["wall_s"])
    return mine[len(mine) // 2] if mine else None


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    keys = [k for k in SERVERS if k in res]
    ratio = res.get("llama_server_over_polykv", {})
    period_ms = 1e3 / cfg.floor_tps
    rows_spec = [
        ("wall time", "wall_s", 1, "s"),
        ("time under the floor, all sessions", "under_floor_total_s", 1, "s"),
        ("time under the floor, worst session", "under_floor_worst_s", 1, "s"),
        ("largest inter-token gap", "largest_gap_s", 2, "s"),
        ("first token per turn, median", "first_token_median_s", 2, "s"),
        ("first token per turn, slowest", "first_token_max_s", 1, "s"),
        ("KV cells in use, peak", "kv_cells_peak", 0, ""),
        ("prompt tokens computed", "prompt_tokens_computed", 0, ""),
        ("tokens generated", "completion_tokens", 0, ""),
        ("compactions", "compactions", 0, ""),
        ("new sessions refused (429)", "refused", 0, ""),
    ]
    headers = ["", *(LABELS[k] for k in keys), "llama-server ÷ PolyKV"]
    rows = []
    for label, n, digits, unit in rows_spec:
        cells = [label + (f", {unit}" if unit else "")]
        cells += [R.fmt(res[k].get(n), digits) for k in keys]
        cells.append(R.fmt(ratio.get(n), 2, 1, "×") if n in ratio else "")
        rows.append(cells)
    foreign = [r["foreign_cpu_cores"] for r in raw["runs"]]
    lines = [
        f"### A planner and {cfg.workers} workers, end to end ({cfg.model}, floor "
        f"{cfg.floor_tps:g} tok/s)",
        "",
        f"{cfg.rounds} rounds: the planner writes the steps, then the {cfg.workers} workers at "
        f"once make a tool call (a JSON schema), wait for the tool ({cfg.tool_pause_s[0]:g}–"
        f"{cfg.tool_pause_s[1]:g} s), send its fixed result ({cfg.tool_words[0]}–"
        f"{cfg.tool_words[1]} words) and answer ({cfg.answer_tokens} tokens); a history more "
        f"than {cfg.compact_budget} tokens past its first prompt is summarised first. One client "
        f"(the OpenAI SDK) for both servers. *Time under the floor*: seconds in which a "
        f"session decoding got no token for longer than the floor period ({period_ms:.0f} ms), "
        f"summed over sessions. *KV cells*: PolyKV's own count; llama-server's, the tokens its "
        f"slots hold. PolyKV: the shared system prompt a pool, the floor enforced on it "
        f"(llama-cpp-python {env.get('llama_cpp_python', '?')} wheel with PolyKV's ggml "
        f"patches); llama-server: upstream, built from the same llama.cpp tree without them, "
        f"its defaults. Median (min–max) of {cfg.reps} repetitions, the servers alternating; "
        f"`-np {cfg.slots} -c {cfg.slots * cfg.slot_ctx} -t {cfg.threads} -fa {cfg.flash_attn}`, "
        f"greedy.",
        "",
        R.markdown_table(headers, rows),
        "",
        R.provenance(
            result_name(cfg.model),
            env,
            foreign,
            command=R.command_line(NAME, cfg.model, Config.model),
        ),
    ]
    return "\n".join(lines)


def result_name(model: str) -> str:
    """Where a run on ``model`` is published (the front page reads the default model's)."""
    return R.result_name(NAME, model, Config.model)


def chart(data: Mapping[str, Any], out_dir: Path) -> list[Path]:
    cfg = data["config"]
    runs = {k: r for k in SERVERS if (r := _series_run(data, k)) is not None}
    return charts.tps_against_floor(
        {LABELS[k]: r["series"] for k, r in runs.items()},
        float(cfg["floor_tps"]),
        out_dir / f"{result_name(cfg['model'])}.png",
        f"{cfg['model']}: mean tokens/s of the sessions decoding (the run of median wall time)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--model", default=Config.model, help="e.g. gemma-3-270m-q4_k_m")
    p.add_argument("--workers", type=int, default=Config.workers)
    p.add_argument("--rounds", type=int, default=Config.rounds)
    p.add_argument("--floor-tps", type=float, default=Config.floor_tps)
    p.add_argument("--compact-budget", type=int, default=Config.compact_budget)
    p.add_argument("--servers", default=",".join(SERVERS), help=f"a subset of {','.join(SERVERS)}")
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (
        rc := R.from_json(
            lambda c: result_name(c.model), args, Config, analyse, render, charts=chart
        )
    ) is not None:
        return rc
    cfg = Config(
        reps=args.reps,
        model=args.model,
        workers=args.workers,
        rounds=args.rounds,
        floor_tps=args.floor_tps,
        compact_budget=args.compact_budget,
        servers=tuple(x for x in SERVERS if x in args.servers.split(",")),
    )
    if args.quick:
        cfg.reps, cfg.rounds = 1, 2
    if cfg.reps < 1 or cfg.workers < 1 or cfg.rounds < 1 or cfg.floor_tps <= 0 or not cfg.servers:
        p.error("--reps, --workers, --rounds >= 1, --floor-tps > 0, --servers non-empty")
    binary = llama_server_or_skip(NAME) if "llama_server" in cfg.servers else None
    if binary is None and "llama_server" in cfg.servers:
        return 0
    return R.run_and_publish(
        result_name(cfg.model),
        cfg,
        args,
        lambda c: measure(c, binary),
        analyse,
        render,
        charts=chart,
    )


if __name__ == "__main__":
    raise SystemExit(main())
