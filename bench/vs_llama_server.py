"""PolyKV against llama-server on plain decode: aggregate tokens/s at 1/2/4/8 streams, on
the bench model and a real quantized instruction model, side by side in one run.

Four columns, each a different build or a different program:

- *llama-server, upstream*: built from the llama.cpp tree vendored in the pinned
  llama-cpp-python sdist (``bench/build_llama_server.sh``), same portable CPU build as the
  engine's wheel, but ggml's own kernels: the wheel carries ggml patches
  (``scripts/patches/``, applied by ``scripts/build-llama-wheel.sh``) that this build lacks.
- *llama-server, patched*: the same source and flags with those patches applied
  (``bench/build_llama_server.sh --patched``): the engine's kernels behind llama-server's
  scheduler. Patched ÷ upstream is what the kernels give; PolyKV ÷ patched is the server.
- *PolyKV*: the engine on its wheel.
- *bare loop*: ``llama_decode`` alone on the engine's wheel (``bench/direct_decode.py``, a
  child process; k one-token sequences per call, no sampling, no HTTP): the limit any server
  on this build could reach. PolyKV ÷ bare loop is the engine's own overhead.

Every column runs with the same OpenMP wait policy, the harness's (``POLYKV_OMP_WAIT_POLICY``,
else the engine's ``auto``), so the wait policy is not what differs. Every repetition visits
the columns in a rotated order, the others stopped; ratios are paired per repetition. The
tokens each server streamed for the same greedy prompts are compared stream by stream.

Workload per level k: k distinct prompts released at one instant, each streaming
``n_predict`` greedy tokens with EOS ignored. Aggregate decode tok/s = tokens after each
stream's first / the union of the streams' [first, last] token spans (prefill excluded).
HTTP responsiveness: while 8 streams decode, a probe asks for one token every 0.3 s on a
ninth slot; its time to first token (p50, p99) shows whether spinning threads starve the
server's own event loop.

Shared prefix (second section): 8 agents whose prompts start with the same
~1.9k-token prefix and end in short distinct suffixes, each asking for one short greedy
answer, on a cold server: upstream llama-server as it comes (a fresh process per run: its slots and
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

llama-server is built (once per flavour, cached) by ``bench/build_llama_server.sh``; where that
fails (no compiler, no network for the sdist), the benchmark says so and skips.

Each section publishes on its own: ``vs_llama_server`` (decode) and
``vs_llama_server_shared`` (shared prefix), a results file and a docs table each.

    python -m bench.vs_llama_server [--reps 6] [--sections decode,shared] [--quick]
    python -m bench.vs_llama_server --from-json bench/results/vs_llama_server.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from . import harness as H
from . import report as R
from . import upstream as U
from .direct_decode import direct_decode_ms
from .engine_client import Api
from .workload import WORDS, word_text

NAME = "vs_llama_server"
SECTIONS = ("decode", "shared")
PUBLISHED = {"decode": NAME, "shared": f"{NAME}_shared"}  # one results file and table each
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
LEVELS = (1, 2, 4, 8)
N_SLOTS = 9  # 8 streams + the responsiveness probe
CTX = 9 * 1024
# The decode columns; the first three are HTTP servers, the last runs llama_decode alone.
UPSTREAM, PATCHED, POLYKV, BARE = "llama_server", "llama_server_patched", "polykv", "bare_loop"
DECODE_KEYS = (UPSTREAM, PATCHED, POLYKV, BARE)
DECODE_LABELS = {
    UPSTREAM: "llama-server, upstream",
    PATCHED: "llama-server, patched",
    POLYKV: "PolyKV",
    BARE: "bare llama_decode loop",
}
# (numerator, denominator, what the ratio isolates), each paired per repetition.
RATIOS = (
    (PATCHED, UPSTREAM, "kernels: patched ÷ upstream llama-server"),
    (POLYKV, PATCHED, "server: PolyKV ÷ patched llama-server"),
    (POLYKV, UPSTREAM, "PolyKV ÷ upstream llama-server"),
    (POLYKV, BARE, "PolyKV ÷ bare loop"),
)
TOKEN_PAIRS = ((UPSTREAM, PATCHED), (PATCHED, POLYKV), (UPSTREAM, POLYKV))
BARE_PROMPT_TOKENS = 40  # about what the streams' prompts tokenize to
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
    reps: int = 6
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
    # The OpenMP wait policy every decode column ran with (the harness's choice); "" in
    # results recorded before it was one for all.
    omp_policy: str = ""


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
def servers(model: Path, cfg: Config, binaries: Mapping[str, str]) -> Iterator[list[Server]]:
    """Both llama-server builds and the engine, each with the harness's OpenMP variables
    (``U.llama_server_env`` gives llama-server the engine's)."""
    common = ["-np", str(N_SLOTS), "-c", str(CTX), "-t", str(cfg.threads), "-fa", cfg.flash_attn]
    for var in OMP_VARS:  # nothing inherited: each child gets exactly H.SERVER_ENV's
        os.environ.pop(var, None)
    with contextlib.ExitStack() as stack:
        out = []
        for key in (UPSTREAM, PATCHED):
            binary = binaries[key]
            ls = H.ServerProcess(
                key.replace("_", "-"),
                [binary, "-m", str(model), *common, "--host", "127.0.0.1", "--port", "{port}",
                 "--no-webui"],
                "/health",
                env=U.llama_server_env(binary),  # H.SERVER_ENV's wait policy included
            )  # fmt: skip
            stack.enter_context(H.server(ls))
            out.append(Server(key, DECODE_LABELS[key], ls.base_url, ls.pid))
        eng = stack.enter_context(H.engine("polykv", model, [*common, "--metrics"]))
        assert eng.proc is not None
        out.append(Server(POLYKV, DECODE_LABELS[POLYKV], eng.base_url, eng.proc.pid))
        yield out


def bare_loop(model: Path, cfg: Config, k: int) -> dict[str, Any]:
    """``llama_decode`` of k one-token sequences per call on the engine's wheel, in a child
    process with the servers' context shape, for as many steps as a stream decodes."""
    ms = direct_decode_ms(
        model,
        [k],
        cfg.threads,
        cfg.flash_attn,
        ctx=CTX,
        n_seq_max=N_SLOTS,
        prompt=BARE_PROMPT_TOKENS,
        steps=cfg.n_predict - 1,
        stat="mean",
    )[k]
    return {"decode_tps": k * 1e3 / ms, "ms_per_step": ms}


class Streamed(NamedTuple):
    """One streamed greedy completion. llama-server sends no event for a token that ends in the
    middle of a UTF-8 character (its bytes go out with the next token's text), so ``tokens``
    can lack ids; ``n_decoded`` (its final event's count) and ``text`` are whole."""

    t_send: float
    t_first: float
    t_last: float
    tokens: list[int]
    text: str
    n_decoded: int


def stream(client: httpx.Client, base: str, text: str, n: int) -> Streamed:
    """One streamed greedy completion of ``n`` tokens."""
    body = {"prompt": text, "n_predict": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_prompt": False}  # fmt: skip
    t_send = time.perf_counter()
    t_first = t_last = 0.0
    tokens: list[int] = []
    pieces: list[str] = []
    predicted: int | None = None
    for now, ev in H.sse_events(client, f"{base}/completion", body):
        toks = ev.get("tokens") or []
        if toks:
            t_first = t_first or now
            t_last = now
            tokens += toks
        pieces.append(ev.get("content") or "")
        if ev.get("stop") and "tokens_predicted" in ev:
            predicted = int(ev["tokens_predicted"])
    n_decoded = len(tokens) if predicted is None else predicted
    if n_decoded != n or len(tokens) > n_decoded:
        raise H.BenchError(
            f"{base}: {n_decoded} tokens decoded ({len(tokens)} streamed), {n} asked"
        )
    return Streamed(t_send, t_first, t_last, tokens, "".join(pieces), n_decoded)


def same_answer(
    a_tokens: Sequence[int], b_tokens: Sequence[int], a_text: str | None, b_text: str | None
) -> bool:
    """Whether two greedy answers agree: token by token where both streams carry every id,
    by their text where one lacks ids (llama-server's withheld mid-character tokens)."""
    if len(a_tokens) == len(b_tokens) or a_text is None or b_text is None:
        return list(a_tokens) == list(b_tokens)
    return a_text == b_text


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
    spans = [(r.t_first, r.t_last) for r in runs]
    decoded = sum(r.n_decoded - 1 for r in runs)
    return {
        "decode_tps": decoded / H.merged_length(spans),
        "first_token_s": max(r.t_first - r.t_send for r in runs),
        "tokens": [r.tokens for r in runs],  # stream by stream, in prompt order
        "texts": [r.text for r in runs],
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
    pieces: list[str] = []
    for now, ev in H.sse_events(client, f"{base}/completion", body):
        if ev.get("tokens"):
            t_first = t_first or now
            tokens += ev["tokens"]
        pieces.append(ev.get("content") or "")
        if ev.get("stop"):
            final = ev
    t_done = time.perf_counter()
    timings = final.get("timings") or {}
    if not t_first or not timings:
        raise H.BenchError(f"{base}: an agent got no token or no final event: {final}")
    # The final event's count: llama-server streams no id for a mid-character token (Streamed).
    decoded = int(final.get("tokens_predicted", len(tokens)))
    if decoded != body["n_predict"]:
        raise H.BenchError(f"{base}: {decoded} tokens decoded, {body['n_predict']} asked")
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
        "text": "".join(pieces),
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


def measure_decode(cfg: Config, binaries: Mapping[str, str], model: str) -> list[dict[str, Any]]:
    path = U.model_path(model)
    runs = []
    H.progress(f"{model}: starting both llama-servers and the engine")
    with servers(path, cfg, binaries) as srvs:
        by_key = {s.key: s for s in srvs}
        for rep in range(cfg.reps):
            order = DECODE_KEYS[rep % len(DECODE_KEYS) :] + DECODE_KEYS[: rep % len(DECODE_KEYS)]
            for k in cfg.levels:
                for key in order:
                    H.progress(f"{model} rep {rep + 1}/{cfg.reps} k={k} {DECODE_LABELS[key]}")
                    # The others stopped: an idle server whose threads spin takes a core.
                    with H.paused([s.pid for s in srvs if s.key != key]):
                        if key == BARE:
                            r = bare_loop(path, cfg, k)
                        else:
                            r = one_level(by_key[key], cfg, model, rep, k)
                    runs.append({"model": model, "rep": rep, "k": k, "server": key, **r})
    return runs


def measure(cfg: Config, binaries: Mapping[str, str]) -> dict[str, Any]:
    """The sections in ``cfg.sections`` (main() measures one at a time)."""
    raw: dict[str, Any] = {
        "env": R.environment(),
        "llama_server": U.llama_server_info(binaries[UPSTREAM]),
        "shared_models": {},
        "runs": [],
        "shared_runs": [],
    }
    if "decode" in cfg.sections:
        raw["llama_server_patched"] = U.llama_server_info(binaries[PATCHED], U.repo_patches())
        raw["wheel"] = U.wheel_build()
    for model in cfg.models:
        if "decode" in cfg.sections:
            raw["runs"] += measure_decode(cfg, binaries, model)
        if "shared" in cfg.sections:
            H.progress(f"{model}: shared prefix, {AGENTS} agents")
            measure_shared(cfg, binaries[UPSTREAM], model, raw)
    return raw


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The index of the first token where two streams differ; None where they agree."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def streams_agree(
    a_streams: Sequence[Sequence[int]],
    b_streams: Sequence[Sequence[int]],
    a_texts: Sequence[str | None] | None = None,
    b_texts: Sequence[str | None] | None = None,
) -> list[bool]:
    """Stream by stream, whether two runs of the same prompts gave the same answer
    (``same_answer``; runs published before texts were recorded have none)."""
    a_texts = a_texts or [None] * len(a_streams)
    b_texts = b_texts or [None] * len(b_streams)
    return [
        same_answer(x, y, sx, sy)
        for x, y, sx, sy in zip(a_streams, b_streams, a_texts, b_texts, strict=True)
    ]


def compare_tokens(
    a_runs: Mapping[int, Any],
    b_runs: Mapping[int, Any],
    a_texts: Mapping[int, Any] | None = None,
    b_texts: Mapping[int, Any] | None = None,
) -> dict[str, Any]:
    """Two servers' streams for the same prompts (repetition -> streams), stream by stream:
    how many agree exactly (``same_answer``), and where each that does not first diverges."""
    diverged: list[int] = []
    compared = 0
    for rep in sorted(set(a_runs) & set(b_runs)):
        agree = streams_agree(
            a_runs[rep], b_runs[rep], (a_texts or {}).get(rep), (b_texts or {}).get(rep)
        )
        for x, y, same in zip(a_runs[rep], b_runs[rep], agree, strict=True):
            compared += 1
            if not same:
                at = first_divergence(x, y)
                diverged.append(min(len(x), len(y)) if at is None else at)
    return {
        "identical": compared - len(diverged),
        "compared": compared,
        "first_divergence": diverged,
    }


def analyse_decode(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    """Per model and stream count: each column's rate, the paired ratios, the probe's
    first-token times at the top level, and the servers' tokens compared pair by pair."""
    runs = raw["runs"]
    out: dict[str, Any] = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        rows: dict[str, Any] = {}
        for k in cfg.levels:

            def of(key: str, field_: str, k: int = k, model: str = model) -> dict[int, Any]:
                return {  # .get: runs published before a field was added lack it
                    r["rep"]: r.get(field_)
                    for r in runs
                    if r["model"] == model and r["k"] == k and r["server"] == key
                }

            tps = {key: of(key, "decode_tps") for key in DECODE_KEYS}
            row: dict[str, Any] = {
                key: H.summarize(list(tps[key].values())).as_dict()
                for key in DECODE_KEYS
                if tps[key]
            }
            row["ratios"] = {}
            for num, den, _ in RATIOS:
                paired = [tps[num][rep] / tps[den][rep] for rep in tps[num] if rep in tps[den]]
                if paired:
                    row["ratios"][f"{num}_over_{den}"] = H.summarize(paired).as_dict()
            if k == max(cfg.levels):
                for key in (UPSTREAM, PATCHED, POLYKV):
                    probes = [p for ps in of(key, "probe_ttft_s").values() for p in ps]
                    if probes:
                        row[f"{key}_probe"] = {
                            "p50": statistics.median(probes),
                            "p99": sorted(probes)[min(len(probes) - 1, int(0.99 * len(probes)))],
                            "n": len(probes),
                        }
            row["tokens"] = {
                f"{a}_vs_{b}": compare_tokens(
                    of(a, "tokens"), of(b, "tokens"), of(a, "texts"), of(b, "texts")
                )
                for a, b in TOKEN_PAIRS
                if tps[a] and tps[b]
            }
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
                        same_answer(x["tokens"], y["tokens"], x.get("text"), y.get("text"))
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
    """The summary of each section measured (and of no other)."""
    out: dict[str, Any] = {}
    if "decode" in cfg.sections:
        out["decode"] = analyse_decode(cfg, raw)
    if "shared" in cfg.sections:
        out["shared"] = analyse_shared(raw)
    return out


def builds(raw: Mapping[str, Any]) -> dict[str, str]:
    """Which build each decode column ran, in words, from what the run recorded."""
    wheel = raw.get("wheel") or {}
    wheel_patches = ", ".join(wheel.get("patches", ())) or "none"
    ls = raw.get("llama_server") or {}
    lp = raw.get("llama_server_patched") or {}
    lp_patches = ", ".join(f"{n} ({sha})" for n, sha in (lp.get("patches") or {}).items())
    where = "the llama.cpp vendored in llama-cpp-python " + str(wheel.get("version", "?"))
    return {
        UPSTREAM: f"llama-server {ls.get('version', '?')} from {where} "
        "(`bench/build_llama_server.sh`): ggml's own kernels, none of our patches",
        PATCHED: "the same source and cmake flags with our ggml patches applied "
        f"(`bench/build_llama_server.sh --patched`: {lp_patches or 'none recorded'})",
        POLYKV: "the engine on its wheel (`scripts/build-llama-wheel.sh`, llama-cpp-python "
        f"{wheel.get('version', '?')}, patches: {wheel_patches})",
        BARE: "`llama_decode` alone on the same wheel (`bench/direct_decode.py`, a child "
        f"process): k one-token sequences per call after a {BARE_PROMPT_TOKENS}-token prompt "
        "each, mean time per call over as many calls as a stream decodes, no sampling, no "
        "HTTP: the limit of any server on this build",
    }


def patches_disagree(raw: Mapping[str, Any]) -> str:
    """A warning where the wheel and the patched llama-server name different patches."""
    wheel = set((raw.get("wheel") or {}).get("patches", ()))
    server = set((raw.get("llama_server_patched") or {}).get("patches") or {})
    if wheel == server:
        return ""
    return (
        f"**The wheel's patches ({', '.join(sorted(wheel)) or 'none'}) are not the patched "
        f"llama-server's ({', '.join(sorted(server)) or 'none'}): its column is not the "
        "engine's kernels.**"
    )


# The patch whose kernel path (fa_runs) sends a lone decoding row's attention to ggml's tiled
# kernel: the same arithmetic for a row whatever its batch, but summed in another order than
# the one-row kernel upstream runs, so greedy tokens may part from upstream's at one stream.
FA_RUNS_PATCH = "ggml-cpu-tiled-fa-runs"


def must_agree_at_one_stream(raw: Mapping[str, Any], a: str, b: str) -> bool:
    """Whether two columns run the same arithmetic for one sequence: always the patched builds
    together; against upstream only where the patches leave a decoding row's attention alone."""
    if UPSTREAM not in (a, b):
        return True
    return FA_RUNS_PATCH not in set((raw.get("wheel") or {}).get("patches", ()))


def token_lines(cfg: Config, rows: Mapping[str, Any], raw: Mapping[str, Any]) -> list[str]:
    """Per server pair: streams identical out of those compared at each stream count, and
    where the ones that differ first diverge."""
    lines = []
    for a, b in TOKEN_PAIRS:
        pair = f"{a}_vs_{b}"
        cells = []
        for k, row in rows.items():
            t = row.get("tokens", {}).get(pair)
            if t is None:
                continue
            cell = f"{t['identical']}/{t['compared']} at {k}"
            if t["first_divergence"]:
                cell += f" (diverging from token {min(t['first_divergence'])})"
            if k == "1" and t["identical"] != t["compared"] and must_agree_at_one_stream(raw, a, b):
                cell = f"**{cell}: a mismatch where they must agree**"
            cells.append(cell)
        if cells:
            lines.append(f"{DECODE_LABELS[a]} against {DECODE_LABELS[b]}: " + ", ".join(cells))
    return lines


def render_decode(cfg: Config, raw: Mapping[str, Any], res: dict[str, Any]) -> list[str]:
    built = builds(raw)
    policy = cfg.omp_policy or "(not recorded)"
    parts = [
        "### Plain decode against llama-server and a bare decode loop",
        "",
        f"{cfg.n_predict} greedy tokens per stream, EOS ignored, k distinct prompts released "
        f"together; `-np {N_SLOTS} -c {CTX} -t {cfg.threads} -fa {cfg.flash_attn}` for every "
        f"server, OpenMP wait policy `{policy}` for every column. Builds: "
        + "; ".join(f"*{DECODE_LABELS[key]}*: {text}" for key, text in built.items())
        + ". Aggregate decode tok/s (tokens after each stream's first over the union of the "
        f"streams' spans), median (min–max) of {cfg.reps} repetitions, the columns visited in "
        "rotated order with the others stopped; ratios paired per repetition. *Probe*: "
        f"one-token requests on a ninth slot every {cfg.probe_interval_s} s while "
        f"{max(cfg.levels)} streams decode, time to first token (the servers answer it in "
        "their measured span at that count, the bare loop has none). *Tokens*: each "
        "server's streams for the same prompts, "
        "compared stream by stream. At 1 stream the two builds with our patches must agree "
        "(one sequence, greedy, the prompt in one batch and one token per step on every "
        "server), and so must upstream where the patches keep its results bit-identical; "
        f"with {FA_RUNS_PATCH} (kernel path `fa_runs`) a decoding row's attention runs on "
        "ggml's tiled kernel, which sums in another order than upstream's one-row kernel, so "
        "upstream may part from them. At 2 and more they may not: the servers group the prompts "
        "and the decode tokens into batches of their own, and ggml picks its matmul path by "
        "batch size, so a stream can diverge once two near-equal logits swap.",
        "",
    ]
    if warn := patches_disagree(raw):
        parts += [warn, ""]
    for model, rows in res.items():
        parts += [f"**{model}**", ""]
        first = next(iter(rows.values()))
        keys = [key for key in DECODE_KEYS if key in first]
        ratios = [
            (f"{n}_over_{d}", label) for n, d, label in RATIOS if f"{n}_over_{d}" in first["ratios"]
        ]
        table = [
            [
                k,
                *(R.fmt(row.get(key), 0) for key in keys),
                *(R.fmt(row["ratios"].get(r), 2, unit="×") for r, _ in ratios),
            ]
            for k, row in rows.items()
        ]
        parts.append(
            R.markdown_table(
                ["streams", *(f"{DECODE_LABELS[key]} tok/s" for key in keys),
                 *(label for _, label in ratios)],
                table,
            )
        )  # fmt: skip
        top = rows[str(max(cfg.levels))]
        probe = [
            f"{DECODE_LABELS[key]}: p50 {top[f'{key}_probe']['p50'] * 1e3:.0f} ms, "
            f"p99 {top[f'{key}_probe']['p99'] * 1e3:.0f} ms ({top[f'{key}_probe']['n']} probes)"
            for key in (UPSTREAM, PATCHED, POLYKV)
            if f"{key}_probe" in top
        ]
        if probe:
            parts += ["", f"Probe during {max(cfg.levels)} streams — " + "; ".join(probe) + "."]
        if lines := token_lines(cfg, rows, raw):
            parts += ["", "Tokens, streams identical — " + "; ".join(lines) + "."]
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
        f"every {cfg.stagger_s:g} s. Servers: upstream llama-server "
        f"({info.get('version', '?')}, built by `bench/build_llama_server.sh` from the "
        "llama.cpp tree of the engine's wheel with ggml's own kernels, without the wheel's "
        "ggml patches) started afresh "
        "for every run (empty slots, empty host-memory prompt cache) with "
        + (
            f"the engine's OpenMP wait policy (`{cfg.omp_policy}`)"
            if cfg.omp_policy
            else "its own OpenMP wait policy"
        )
        + " and its caching defaults"
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


def provenance_note(raw: Mapping[str, Any]) -> str:
    """The binaries each server ran, for the line under the tables."""
    ran = [f"upstream llama-server `{(raw.get('llama_server') or {}).get('binary', '?')}`"]
    if lp := raw.get("llama_server_patched"):
        ran.append(f"patched llama-server `{lp.get('binary', '?')}`")
    if wheel := raw.get("wheel"):
        ran.append(
            f"PolyKV and the bare loop on the wheel llama-cpp-python {wheel.get('version', '?')} "
            f"with {', '.join(wheel.get('patches', ())) or 'no patches'}"
        )
    return "Builds: " + "; ".join(ran) + "."


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    parts: list[str] = []
    if res.get("decode"):
        parts += render_decode(cfg, raw, res["decode"])
    if res.get("shared"):
        parts += render_shared(cfg, raw, res["shared"])
    name = PUBLISHED[cfg.sections[0]] if len(cfg.sections) == 1 else NAME
    parts.append(R.provenance(name, raw["env"], note=provenance_note(raw), command=command(cfg)))
    return "\n".join(parts)


def command(cfg: Config) -> str:
    """How to measure this section again."""
    return f"python -m bench.{NAME} --sections {','.join(cfg.sections)} --reps {cfg.reps}"


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
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--n-predict", type=int, default=128)
    p.add_argument("--models", default="bench,smollm2-135m-instruct-q4_1")
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="decode: stream counts")
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
    if args.from_json is not None:
        name = json.loads(args.from_json.read_text())["benchmark"]
        return R.from_json(name, args, Config, analyse, render, charts=chart) or 0
    cfg = Config(
        reps=args.reps,
        n_predict=args.n_predict,
        models=tuple(args.models.split(",")),
        levels=tuple(int(x) for x in args.levels.split(",")),
        sections=args.sections,
        shared_prefix_tokens=args.prefix_tokens,
        stagger_s=args.stagger_s,
        flash_attn=args.flash_attn,
        omp_policy=H.OMP_CHOICE.policy,
    )
    if args.quick:
        cfg.reps, cfg.n_predict, cfg.levels = 1, 16, (1, 8)
        cfg.shared_prefix_tokens, cfg.stagger_s, cfg.answer_tokens = 400, 0.2, 8
    if cfg.reps < 1 or not 200 <= cfg.shared_prefix_tokens <= SLOT_CTX - 200:
        p.error(f"--reps must be >= 1 and --prefix-tokens in 200..{SLOT_CTX - 200}")
    if not cfg.levels or not all(1 <= k <= N_SLOTS - 1 for k in cfg.levels):
        p.error(f"--levels: stream counts in 1..{N_SLOTS - 1}")
    binaries = {UPSTREAM: U.llama_server_or_skip(NAME)}
    if "decode" in cfg.sections:
        binaries[PATCHED] = U.llama_server_or_skip(NAME, patched=True)
    if None in binaries.values():
        return 0
    built = {k: v for k, v in binaries.items() if v is not None}
    for section in cfg.sections:  # each publishes its own results file and table
        one = dataclasses.replace(cfg, sections=(section,))
        rc = R.run_and_publish(
            PUBLISHED[section],
            one,
            args,
            lambda c: measure(c, built),
            analyse,
            render,
            bulky=("runs", "shared_runs"),
            charts=chart,
        )
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
