"""PolyKV against upstream llama-server on plain decode: aggregate tokens/s at 1/2/4/8
streams, on the bench model and a real quantized instruction model, side by side in one run.

llama-server is built from the llama.cpp tree vendored in the pinned llama-cpp-python sdist
(``bench/build_llama_server.sh``), with the same portable CPU build, so both servers run the
same kernels. The engine runs three times, once per OpenMP wait policy (passive: idle
compute threads sleep at every barrier; default: libgomp's, a short spin then sleep, as
llama-server runs; active: they spin), to decide the engine's default by measurement.
Every repetition visits the servers in a rotated order, and the tokens each server produced
for the same greedy prompt are compared.

Workload per level k: k distinct prompts released at one instant, each streaming
``n_predict`` greedy tokens with EOS ignored. Aggregate decode tok/s = tokens after each
stream's first / the union of the streams' [first, last] token spans (prefill excluded).
HTTP responsiveness: while 8 streams decode, a probe asks for one token every 0.3 s on a
ninth slot; its time to first token (p50, p99) shows whether spinning threads starve the
server's own event loop.

Shared prefix (second section): 8 agents whose prompts start with the same
~1.9k-token prefix and end in short distinct suffixes, each asking for one short greedy
answer, on a cold server: llama-server as it comes (a fresh process per run: its slots and
its host-memory prompt cache empty; its own prompt-cache defaults, read from its ``--help``
and recorded), PolyKV with automatic prefix sharing (no pool) and PolyKV with the prefix
resident as a pool created beforehand (timed apart) and attached by ``pool_id`` (the engine
with every slot erased and every pool released before each run). Two arrival patterns:
*fan-out*, all 8 released at one instant, and *staggered*, one agent every 0.5 s. Per agent
the client measures the time to its first token; after the run, KV cells in use (PolyKV: the
engine's own count; llama-server: the tokens each slot holds, its slots share nothing) and
the prompt tokens each server computed. ``--reps`` repetitions in rotated server order;
ratios are paired per repetition. A chart of first-token time per agent is drawn beside the
results.

llama-server is built (once, cached) by ``bench/build_llama_server.sh``; where that fails
(no compiler, no network for the sdist), the benchmark says so and skips.

    python -m bench.vs_llama_server [--reps 3] [--sections decode,shared] [--quick]
    python -m bench.vs_llama_server --from-json bench/results/vs_llama_server.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from . import harness as H
from . import report as R
from . import upstream as U
from .engine_client import Api
from .workload import WORDS, word_text

NAME = "vs_llama_server"
# How ggml's OpenMP threads wait for the next graph (polykv_engine/llama/omp.py): spin a
# while then sleep (the shipped default), sleep at once, libgomp's default (what llama-server
# runs with), spin without end. The engine's default is chosen from this table.
OMP_POLICIES = ("spin", "passive", "default", "active")
POLYKV_KEYS = tuple(f"polykv_{p}" for p in OMP_POLICIES)
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
LEVELS = (1, 2, 4, 8)
N_SLOTS = 9  # 8 streams + the responsiveness probe
CTX = 9 * 1024
SECTIONS = ("decode", "shared")
# Shared-prefix section: one slot per agent; llama-server splits -c evenly across its slots
# (an explicit -np turns its unified KV off), so each of its slots gets SLOT_CTX cells,
# room for the prefix, a suffix and the answer. The engine gets the same -np and -c (one
# unified cache).
AGENTS = 8
SLOT_CTX = 2304
SHARED_CTX = AGENTS * SLOT_CTX
SHARED_PREFIX_TOKENS = 1900
ARRIVALS = ("fanout", "staggered")
ARRIVAL_LABELS = {"fanout": "fan-out", "staggered": "staggered"}
SHARED_SERVERS = ("llama_server", "polykv_auto", "polykv_pool")
SHARED_LABELS = {
    "llama_server": "llama-server",
    "polykv_auto": "PolyKV, automatic sharing",
    "polykv_pool": "PolyKV, pool attached",
}
_PROMPT_WORDS = WORDS[:25]  # the short list these prompts were first made with


@dataclass
class Config:
    reps: int = 3
    n_predict: int = 128
    threads: int = 2
    models: tuple[str, ...] = ("bench", "smollm2-135m-instruct-q4_1")
    levels: tuple[int, ...] = LEVELS
    probe_interval_s: float = 0.3
    sections: tuple[str, ...] = SECTIONS
    shared_prefix_tokens: int = SHARED_PREFIX_TOKENS
    stagger_s: float = 0.5
    answer_tokens: int = 16
    # The same -fa for every server. "on" is both servers' CPU default (llama-server's auto
    # resolves to it on a CPU, and so does the engine's); results recorded before this
    # setting existed ran with "off", hence the dataclass default.
    flash_attn: str = "off"


@dataclass
class Server:
    key: str
    label: str
    base_url: str
    pid: int


def prompt(model: str, rep: int, k: int, i: int) -> str:
    rng = random.Random(f"{model}/{rep}/{k}/{i}")
    return f"Note {i}: " + " ".join(rng.choice(_PROMPT_WORDS) for _ in range(24)) + "."


@contextlib.contextmanager
def servers(model: Path, cfg: Config, binary: str) -> Iterator[list[Server]]:
    common = ["-np", str(N_SLOTS), "-c", str(CTX), "-t", str(cfg.threads), "-fa", cfg.flash_attn]
    for var in OMP_VARS:  # children inherit no wait policy: each server runs its own default
        os.environ.pop(var, None)
    with contextlib.ExitStack() as stack:
        out = []
        ls = H.ServerProcess(
            "llama-server",
            [
                binary,
                "-m",
                str(model),
                *common,
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--no-webui",
            ],
            "/health",
            env=U.llama_server_env(binary),
        )
        stack.enter_context(H.server(ls))
        out.append(Server("llama_server", "llama-server", ls.base_url, ls.pid))
        for policy in OMP_POLICIES:
            # The engine's own knob, with any inherited OMP_WAIT_POLICY removed, so "default"
            # really is libgomp's default.
            env = {"POLYKV_OMP_WAIT_POLICY": policy}
            eng = stack.enter_context(
                H.engine(f"polykv-{policy}", model, [*common, "--metrics"], env)
            )
            assert eng.proc is not None
            label = f"PolyKV ({policy} threads)"
            out.append(Server(f"polykv_{policy}", label, eng.base_url, eng.proc.pid))
        yield out


def stream(
    client: httpx.Client, base: str, text: str, n: int
) -> tuple[float, float, float, list[int]]:
    """(t_send, t_first, t_last, tokens) of one streamed greedy completion."""
    body = {"prompt": text, "n_predict": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_prompt": False}  # fmt: skip
    t_send = time.perf_counter()
    t_first = t_last = 0.0
    tokens: list[int] = []
    for now, ev in H.sse_events(client, f"{base}/completion", body):
        toks = ev.get("tokens") or []
        if toks:
            t_first = t_first or now
            t_last = now
            tokens += toks
    if len(tokens) != n:
        raise H.BenchError(f"{base}: {len(tokens)} tokens streamed, {n} asked")
    return t_send, t_first, t_last, tokens


def one_level(srv: Server, cfg: Config, model: str, rep: int, k: int) -> dict[str, Any]:
    with H.http_client() as client:
        probes: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.wait(cfg.probe_interval_s):
                t0 = time.perf_counter()
                body = {"prompt": "probe", "n_predict": 1, "cache_prompt": False}
                r = client.post(f"{srv.base_url}/completion", json=body)
                if r.status_code == 200:
                    probes.append(time.perf_counter() - t0)

        prober = threading.Thread(target=probe, daemon=True)
        fns = [
            (lambda i=i: stream(client, srv.base_url, prompt(model, rep, k, i), cfg.n_predict))
            for i in range(k)
        ]
        started = [False]
        H.open_connections(client, srv.base_url, k)

        def released() -> None:
            if k == max(cfg.levels):
                prober.start()
                started[0] = True

        runs = H.run_together(fns, released)
        stop.set()
        if started[0]:
            prober.join(30)
    spans = [(first, last) for _, first, last, _ in runs]
    decoded = sum(len(toks) - 1 for *_, toks in runs)
    return {
        "decode_tps": decoded / H.merged_length(spans),
        "first_token_s": max(first - send for send, first, _, _ in runs),
        "tokens": runs[0][3],
        "probe_ttft_s": probes,
    }


# ---------------------------------------------------------------------------- shared prefix


@dataclass(frozen=True, slots=True)
class Agents:
    """One repetition's prompts: the prefix every agent shares and a short suffix each."""

    prefix: list[int]
    suffixes: list[list[int]]

    def prompt(self, i: int) -> list[int]:
        return self.prefix + self.suffixes[i]


def make_agents(api: Api, model: str, rep: int, prefix_tokens: int) -> Agents:
    """Token lists through the engine's tokenizer (both servers load the same model)."""
    head = "Instructions shared by every agent of this team. "
    prefix = api.tokenize(head + word_text(f"{model}/prefix", prefix_tokens), add_special=True)
    if len(prefix) < prefix_tokens:
        raise H.BenchError(f"prefix text gave only {len(prefix)} tokens")
    suffixes = [
        api.tokenize(
            f" Agent {i + 1}, your task: {word_text(f'{model}/{rep}/{i}', 12)}. Answer:",
            add_special=False,
        )
        for i in range(AGENTS)
    ]
    return Agents(prefix[:prefix_tokens], suffixes)


def agent_body(prompt: Sequence[int], n: int, pool: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": list(prompt),
        "n_predict": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "cache_prompt": True,
    }
    if pool is not None:
        body["pool_id"] = pool
    return body


def agent_turn(
    client: httpx.Client, base: str, body: dict[str, Any], delay: float
) -> dict[str, Any]:
    """One agent: wait ``delay`` after the release, send, stream the answer."""
    t_release = time.perf_counter()
    time.sleep(delay)
    t_send = time.perf_counter()
    t_first = 0.0
    tokens: list[int] = []
    final: dict[str, Any] = {}
    for now, ev in H.sse_events(client, f"{base}/completion", body):
        if ev.get("tokens"):
            t_first = t_first or now
            tokens += ev["tokens"]
        if ev.get("stop"):
            final = ev
    t_done = time.perf_counter()
    timings = final.get("timings") or {}
    if not t_first or not timings:
        raise H.BenchError(f"{base}: an agent got no token or no final event: {final}")
    if len(tokens) != body["n_predict"]:
        raise H.BenchError(f"{base}: {len(tokens)} tokens streamed, {body['n_predict']} asked")
    return {
        "sent_s": t_send - t_release,
        "ttft_s": t_first - t_send,
        "done_s": t_done - t_release,
        "prompt_tokens": len(body["prompt"]),
        "prompt_n": int(timings["prompt_n"]),
        "cache_n": int(timings["cache_n"]),
        "id_slot": final.get("id_slot"),
        "tokens_cached": final.get("tokens_cached"),
        "tokens": tokens,
    }


def release_agents(
    client: httpx.Client,
    base: str,
    pid: int,
    agents: Agents,
    cfg: Config,
    arrival: str,
    pool: str | None = None,
) -> dict[str, Any]:
    """All agents, released together (fan-out) or one every ``stagger_s`` (staggered)."""
    step = cfg.stagger_s if arrival == "staggered" else 0.0
    fns = [
        functools.partial(
            agent_turn,
            client,
            base,
            agent_body(agents.prompt(i), cfg.answer_tokens, pool),
            i * step,
        )
        for i in range(AGENTS)
    ]
    H.open_connections(client, base, AGENTS)
    with H.CpuWatch([pid]) as cpu:
        results = H.run_together(fns, lambda: None)
    return {"agents": results, "foreign_cpu_cores": cpu.foreign_cores}


def warm_up(client: httpx.Client, base: str) -> None:
    """One tiny request (no shared tokens with the agents) before anything is timed."""
    body = {"prompt": "Hello", "n_predict": 1, "cache_prompt": False}
    r = client.post(f"{base}/completion", json=body)
    if r.status_code != 200:
        raise H.BenchError(f"{base}: warm-up -> {r.status_code}: {r.text[:300]}")


def llama_server_run(
    client: httpx.Client, binary: str, model: Path, cfg: Config, agents: Agents, arrival: str
) -> dict[str, Any]:
    """A fresh llama-server per run: no slot and no host-memory prompt cache holds anything."""
    ls = H.ServerProcess(
        "llama-server-shared",
        [
            binary,
            "-m",
            str(model),
            "-np",
            str(AGENTS),
            "-c",
            str(SHARED_CTX),
            "-t",
            str(cfg.threads),
            "-fa",
            cfg.flash_attn,
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--no-webui",
        ],
        "/health",
        env=U.llama_server_env(binary),
    )
    with H.server(ls):
        warm_up(client, ls.base_url)
        run = release_agents(client, ls.base_url, ls.pid, agents, cfg, arrival)
    # Its slots share no cells: KV in use is what each slot holds after its last agent.
    held: dict[int, int] = {}
    for a in sorted(run["agents"], key=lambda a: a["done_s"]):
        held[int(a["id_slot"])] = int(a["tokens_cached"])
    return {**run, "kv_cells": sum(held.values()), "kv_source": "tokens held per slot"}


def polykv_run(
    api: Api, cfg: Config, agents: Agents, arrival: str, pool: str | None
) -> dict[str, Any]:
    """On an engine with every slot erased and every pool released (checked)."""
    api.reset(AGENTS)
    create_s = None
    if pool is not None:
        created, create_s = api.create_pool(pool, agents.prefix)
        if created["prefix_len"] != len(agents.prefix):
            raise H.BenchError(f"pool prefix_len {created['prefix_len']} != {len(agents.prefix)}")
    run = release_agents(api.client, api.base_url, api.pid, agents, cfg, arrival, pool)
    if pool is not None and any(a["cache_n"] < len(agents.prefix) for a in run["agents"]):
        raise H.BenchError(f"an agent attached to {pool} prefilled the prefix again")
    kv = api.pools()
    api.reset(AGENTS)
    return {
        **run,
        "kv_cells": int(kv["kv_cells_used"]),
        "kv_source": "engine",
        "create_s": create_s,
    }


def measure_shared(cfg: Config, binary: str, model: str, raw: dict[str, Any]) -> None:
    path = U.model_path(model)
    args = [
        "-np",
        str(AGENTS),
        "-c",
        str(SHARED_CTX),
        "-t",
        str(cfg.threads),
        "-fa",
        cfg.flash_attn,
        "--metrics",
        # Parking off: caches of agents that finished early stay in the KV cache and count in
        # "KV in use" (llama-server's host-memory cache is not counted either).
        "--polykv-park-mib",
        "0",
    ]
    with H.http_client() as client, H.engine("polykv-shared", path, args) as eng:
        assert eng.proc is not None
        api = Api(client, eng.base_url, eng.proc.pid)
        warm_up(client, api.base_url)
        raw["shared_models"][model] = {
            "kv_bytes_per_token": int(api.pools()["kv_bytes_per_token"]),
            "prefix_tokens": cfg.shared_prefix_tokens,
        }
        for rep in range(cfg.reps):
            agents = make_agents(api, model, rep, cfg.shared_prefix_tokens)
            i = rep % len(SHARED_SERVERS)
            order = SHARED_SERVERS[i:] + SHARED_SERVERS[:i]
            for arrival in ARRIVALS:
                for key in order:
                    if key == "llama_server":
                        run = llama_server_run(client, binary, path, cfg, agents, arrival)
                    else:
                        pool = f"agents-{rep}-{arrival}" if key == "polykv_pool" else None
                        run = polykv_run(api, cfg, agents, arrival, pool)
                    ttft = [a["ttft_s"] for a in run["agents"]]
                    H.progress(
                        f"{model} rep {rep + 1}/{cfg.reps} {arrival:<9} {SHARED_LABELS[key]:<26} "
                        f"first token median {statistics.median(ttft):6.2f} s, slowest "
                        f"{max(ttft):6.2f} s, KV {run['kv_cells']} cells"
                    )
                    raw["shared_runs"].append(
                        {
                            "model": model,
                            "rep": rep,
                            "arrival": arrival,
                            "server": key,
                            "prefix_tokens": len(agents.prefix),
                            "suffix_tokens": [len(x) for x in agents.suffixes],
                            **run,
                        }
                    )


# ---------------------------------------------------------------------------- the benchmark


def measure(cfg: Config, binary: str) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "env": R.environment(),
        "llama_server": U.llama_server_info(binary),
        "shared_models": {},
        "runs": [],
        "shared_runs": [],
    }
    for model in cfg.models:
        if "decode" in cfg.sections:
            path = U.model_path(model)
            H.progress(f"{model}: starting llama-server and {len(OMP_POLICIES)} engines")
            with servers(path, cfg, binary) as srvs:
                for rep in range(cfg.reps):
                    order = srvs[rep % len(srvs) :] + srvs[: rep % len(srvs)]
                    for k in cfg.levels:
                        for srv in order:
                            H.progress(f"{model} rep {rep + 1}/{cfg.reps} k={k} {srv.label}")
                            # The others stopped: an idle `active` engine spins a core.
                            with H.paused([s.pid for s in srvs if s is not srv]):
                                r = one_level(srv, cfg, model, rep, k)
                            raw["runs"].append({"model": model, "rep": rep, "k": k,
                                                "server": srv.key, **r})  # fmt: skip
        if "shared" in cfg.sections:
            H.progress(f"{model}: shared prefix, {AGENTS} agents")
            measure_shared(cfg, binary, model, raw)
    return raw


def analyse_decode(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    runs = raw["runs"]
    out: dict[str, Any] = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        rows: dict[str, Any] = {}
        for k in cfg.levels:

            def of(key: str, field_: str, k: int = k, model: str = model) -> list[Any]:
                return [
                    r[field_]
                    for r in runs
                    if r["model"] == model and r["k"] == k and r["server"] == key
                ]

            row: dict[str, Any] = {}
            ls = of("llama_server", "decode_tps")
            for key in ("llama_server", *POLYKV_KEYS):
                row[key] = H.summarize(of(key, "decode_tps")).as_dict()
            for key in POLYKV_KEYS:
                paired = [a / b for a, b in zip(of(key, "decode_tps"), ls, strict=True)]
                row[f"{key}_ratio"] = H.summarize(paired).as_dict()
            if k == max(cfg.levels):
                for key in ("llama_server", *POLYKV_KEYS):
                    probes = [p for ps in of(key, "probe_ttft_s") for p in ps]
                    if probes:
                        row[f"{key}_probe"] = {
                            "p50": statistics.median(probes),
                            "p99": sorted(probes)[min(len(probes) - 1, int(0.99 * len(probes)))],
                            "n": len(probes),
                        }
            toks = {key: of(key, "tokens") for key in ("llama_server", "polykv_passive")}
            row["identical_tokens"] = sum(
                a == b for a, b in zip(toks["llama_server"], toks["polykv_passive"], strict=True)
            )
            row["compared"] = len(toks["llama_server"])
            rows[str(k)] = row
        out[model] = rows
    return out


def _ttfts(run: Mapping[str, Any]) -> list[float]:
    return [float(a["ttft_s"]) for a in run["agents"]]


def per_agent_ttft(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Agent by agent (in arrival order): median, min and max first-token time over runs."""
    n = min((len(r["agents"]) for r in runs), default=0)
    out = []
    for i in range(n):
        values = [float(r["agents"][i]["ttft_s"]) for r in runs]
        out.append({"median": statistics.median(values), "min": min(values), "max": max(values)})
    return out


def analyse_shared(raw: dict[str, Any]) -> dict[str, Any]:
    """Per model and arrival: each server's first-token times, prompt tokens computed and KV,
    and against llama-server (paired by repetition): how many times sooner the median and
    the slowest agent's first token came, how many times less KV, how many same answers."""
    runs: list[dict[str, Any]] = raw.get("shared_runs") or []
    out: dict[str, Any] = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        bpt = int(raw["shared_models"][model]["kv_bytes_per_token"])
        per_arrival: dict[str, Any] = {}
        for arrival in ARRIVALS:

            def of(key: str, model: str = model, arrival: str = arrival) -> list[dict[str, Any]]:
                return sorted(
                    (
                        r
                        for r in runs
                        if r["model"] == model and r["arrival"] == arrival and r["server"] == key
                    ),
                    key=lambda r: r["rep"],
                )

            ls = {r["rep"]: r for r in of("llama_server")}
            row: dict[str, Any] = {}
            for key in SHARED_SERVERS:
                rs = of(key)
                if not rs:
                    continue
                cell: dict[str, Any] = {
                    "ttft_s_median": H.summarize(
                        [statistics.median(_ttfts(r)) for r in rs]
                    ).as_dict(),
                    "ttft_s_max": H.summarize([max(_ttfts(r)) for r in rs]).as_dict(),
                    "prompt_tokens_computed": H.summarize(
                        [sum(a["prompt_n"] for a in r["agents"]) for r in rs]
                    ).as_dict(),
                    "kv_cells": H.summarize([r["kv_cells"] for r in rs]).as_dict(),
                    "kv_bytes": H.summarize([r["kv_cells"] * bpt for r in rs]).as_dict(),
                    "per_agent_ttft_s": per_agent_ttft(rs),
                    "foreign_cpu_cores": H.summarize(
                        [r["foreign_cpu_cores"] for r in rs]
                    ).as_dict(),
                }
                if key == "polykv_pool":
                    cell["create_s"] = H.summarize([r["create_s"] for r in rs]).as_dict()
                pairs = [(ls[r["rep"]], r) for r in rs if r["rep"] in ls]
                if key != "llama_server" and pairs:
                    cell["sooner_median"] = H.summarize(
                        [
                            statistics.median(_ttfts(a)) / statistics.median(_ttfts(b))
                            for a, b in pairs
                        ]
                    ).as_dict()
                    cell["sooner_slowest"] = H.summarize(
                        [max(_ttfts(a)) / max(_ttfts(b)) for a, b in pairs]
                    ).as_dict()
                    cell["less_kv"] = H.summarize(
                        [a["kv_cells"] / b["kv_cells"] for a, b in pairs]
                    ).as_dict()
                    same = [
                        x["tokens"] == y["tokens"]
                        for a, b in pairs
                        for x, y in zip(a["agents"], b["agents"], strict=True)
                    ]
                    cell["same_answers"] = sum(same)
                    cell["compared"] = len(same)
                row[key] = cell
            per_arrival[arrival] = row
        out[model] = per_arrival
    return out


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    return {"decode": analyse_decode(cfg, raw), "shared": analyse_shared(raw)}


def render_decode(cfg: Config, res: dict[str, Any]) -> list[str]:
    parts = [
        "### Plain decode against upstream llama-server",
        "",
        f"{cfg.n_predict} greedy tokens per stream, EOS ignored, k distinct prompts released "
        f"together; `-np {N_SLOTS} -c {CTX} -t {cfg.threads} -fa {cfg.flash_attn}` for every "
        "server; "
        "llama-server built from the llama.cpp tree the engine runs on "
        "(`bench/build_llama_server.sh`, same portable CPU build). Aggregate decode tok/s, "
        f"median (min–max) of {cfg.reps} repetitions in rotated server order; ratios are "
        "paired per repetition. *Probe*: one-token requests on a ninth slot every "
        f"{cfg.probe_interval_s} s while 8 streams decode, time to first token.",
        "",
    ]
    for model, rows in res.items():
        parts.append(f"**{model}**")
        parts.append("")
        table = []
        keys = [k for k in POLYKV_KEYS if k in next(iter(rows.values()))]
        for k, row in rows.items():
            table.append([
                k,
                H.Summary(tuple(row["llama_server"]["values"])).fmt(0),
                *(H.Summary(tuple(row[key]["values"])).fmt(0) for key in keys),
                *(H.Summary(tuple(row[f"{key}_ratio"]["values"])).fmt(2, unit="×") for key in keys),
                f"{row['identical_tokens']}/{row['compared']}",
            ])  # fmt: skip
        names = [key.removeprefix("polykv_") for key in keys]
        parts.append(R.markdown_table(
            ["streams", "llama-server tok/s", *(f"PolyKV {n} tok/s" for n in names),
             *(f"{n} ÷ llama-server" for n in names), "same tokens"],
            table,
        ))  # fmt: skip
        top = rows[str(max(cfg.levels))]
        labels = {"llama_server": "llama-server"} | {
            key: f"PolyKV {key.removeprefix('polykv_')}" for key in keys
        }
        probe = [
            f"{label}: p50 {top[f'{key}_probe']['p50'] * 1e3:.0f} ms, "
            f"p99 {top[f'{key}_probe']['p99'] * 1e3:.0f} ms ({top[f'{key}_probe']['n']} probes)"
            for key, label in labels.items()
            if f"{key}_probe" in top
        ]
        if probe:
            parts += ["", "Probe during 8 streams — " + "; ".join(probe) + "."]
        parts.append("")
    return parts


def render_shared(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> list[str]:
    info = raw.get("llama_server") or {}
    defaults = info.get("defaults") or {}
    stated = "; ".join(f"`{flag}`: {value or '(none stated)'}" for flag, value in defaults.items())
    parts = [
        "### Shared prefix against upstream llama-server",
        "",
        f"{AGENTS} agents on one {cfg.shared_prefix_tokens}-token prefix (BOS first), each with "
        "its own short suffix, each asking for "
        f"{cfg.answer_tokens} greedy tokens (EOS ignored, `cache_prompt: true`); every run on "
        "a cold server. *Fan-out*: all agents released at one instant; *staggered*: one agent "
        f"every {cfg.stagger_s:g} s. Servers: llama-server "
        f"({info.get('version', '?')}, built by `bench/build_llama_server.sh`) started afresh "
        "for every run (empty slots, empty host-memory prompt cache) with its own OpenMP wait "
        "policy and its caching defaults"
        + (f" ({stated})" if stated else "")
        + "; PolyKV with automatic prefix sharing, no pool; PolyKV with the prefix as a pool, "
        "created before the agents (its time apart, not in theirs) and attached by "
        "`pool_id`. PolyKV runs start with every slot erased and every pool released, with "
        "parking off (`--polykv-park-mib 0`), so every cache counts in KV in use. "
        f"Both: `-np {AGENTS} -c {SHARED_CTX} -t {cfg.threads} -fa {cfg.flash_attn}`; "
        "llama-server splits "
        f"that context into {SLOT_CTX} cells per slot (an explicit `-np` turns its unified KV "
        "off), the engine keeps one unified cache. First token: measured by the client from "
        f"each agent's own send; median (min–max) of {cfg.reps} repetitions in rotated server "
        "order, ratios paired per repetition. *Prompt tokens computed*: the servers' own "
        "`prompt_n`, summed over the agents. *KV in use* after the run: PolyKV's cell count; "
        "llama-server's slots share no cells, so the tokens each slot holds after its last "
        "agent, times the same bytes/token (same model, f16 K and V).",
        "",
    ]
    for model, per_arrival in res.items():
        bpt = raw["shared_models"][model]["kv_bytes_per_token"]
        parts += [f"**{model}**", ""]
        table = []
        for arrival, row in per_arrival.items():
            for key, cell in row.items():
                table.append(
                    [
                        ARRIVAL_LABELS[arrival],
                        SHARED_LABELS[key],
                        R.fmt(cell["ttft_s_median"], 2, unit=" s"),
                        R.fmt(cell["ttft_s_max"], 2, unit=" s"),
                        "–"
                        if "sooner_median" not in cell
                        else f"{cell['sooner_median']['median']:.1f}× / "
                        f"{cell['sooner_slowest']['median']:.1f}×",
                        f"{cell['prompt_tokens_computed']['median']:,.0f}",
                        f"{cell['kv_cells']['median']:,.0f} cells, "
                        f"{cell['kv_cells']['median'] * bpt / 1e6:.1f} MB",
                        "–" if "less_kv" not in cell else f"{cell['less_kv']['median']:.1f}×",
                    ]
                )
        parts.append(
            R.markdown_table(
                [
                    "arrival",
                    "server",
                    "first token, median agent",
                    "slowest agent",
                    "sooner than llama-server (median agent / slowest)",
                    "prompt tokens computed",
                    "KV in use",
                    "less KV than llama-server",
                ],
                table,
            )
        )
        created = [
            f"{R.fmt(row['polykv_pool']['create_s'], 2, unit=' s')} ({ARRIVAL_LABELS[arrival]})"
            for arrival, row in per_arrival.items()
            if "create_s" in row.get("polykv_pool", {})
        ]
        if created:
            parts += ["", "Pool creation, once before the agents: " + ", ".join(created) + "."]
        same: dict[str, list[int]] = {}
        for row in per_arrival.values():
            for key, cell in row.items():
                if "same_answers" in cell:
                    tally = same.setdefault(key, [0, 0])
                    tally[0] += cell["same_answers"]
                    tally[1] += cell["compared"]
        if same:
            parts += [
                "",
                "Greedy answers equal to llama-server's, agent by agent: "
                + "; ".join(f"{SHARED_LABELS[k]} {a}/{b}" for k, (a, b) in same.items())
                + ".",
            ]
        parts.append("")
    return parts


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    parts: list[str] = []
    if res.get("decode"):
        parts += render_decode(cfg, res["decode"])
    if res.get("shared"):
        parts += render_shared(cfg, raw, res["shared"])
    parts.append(R.provenance(NAME, env))
    return "\n".join(parts)


def chart(data: Mapping[str, Any], out_dir: Path) -> list[Path]:
    if not data.get("shared_runs"):
        return []
    from . import charts  # matplotlib only where charts are drawn

    return charts.first_token_per_agent(
        data, out_dir, f"{NAME}_shared_prefix.png", SHARED_LABELS, ARRIVAL_LABELS
    )


def _sections(text: str) -> tuple[str, ...]:
    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    if not chosen or set(chosen) - set(SECTIONS):
        raise argparse.ArgumentTypeError(f"sections: a comma-separated subset of {SECTIONS}")
    return tuple(x for x in SECTIONS if x in chosen)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-predict", type=int, default=128)
    p.add_argument("--models", default="bench,smollm2-135m-instruct-q4_1")
    p.add_argument("--sections", type=_sections, default=SECTIONS, help="decode,shared")
    p.add_argument(
        "--prefix-tokens",
        type=int,
        default=SHARED_PREFIX_TOKENS,
        help="shared section: the agents' common prefix",
    )
    p.add_argument("--stagger-s", type=float, default=0.5, help="staggered arrivals: the gap")
    p.add_argument(
        "--flash-attn",
        choices=("on", "off"),
        default="on",
        help="-fa for every server (on: what both run by default on a CPU)",
    )
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render, charts=chart)) is not None:
        return rc
    cfg = Config(
        reps=args.reps,
        n_predict=args.n_predict,
        models=tuple(args.models.split(",")),
        sections=args.sections,
        shared_prefix_tokens=args.prefix_tokens,
        stagger_s=args.stagger_s,
        flash_attn=args.flash_attn,
    )
    if args.quick:
        cfg.reps, cfg.n_predict, cfg.levels = 1, 16, (1, 8)
        cfg.shared_prefix_tokens, cfg.stagger_s, cfg.answer_tokens = 400, 0.2, 8
    if cfg.reps < 1 or not 200 <= cfg.shared_prefix_tokens <= SLOT_CTX - 200:
        p.error(f"--reps must be >= 1 and --prefix-tokens in 200..{SLOT_CTX - 200}")
    if (binary := U.llama_server_or_skip(NAME)) is None:
        return 0
    return R.run_and_publish(
        NAME,
        cfg,
        args,
        lambda c: measure(c, binary),
        analyse,
        render,
        bulky=("runs", "shared_runs"),
        charts=chart,
    )


if __name__ == "__main__":
    raise SystemExit(main())
