"""Long shared prefixes, 8 agents, PolyKV (the prefix a pool) against upstream llama-server
on the same model, build and flags, side by side in one run.

Agent harnesses send 10-30k tokens before the first user word. Here 8 agents share one long
prefix: 16k tokens on Gemma 3 270M (a sliding-window model: the engine holds the pool with a
full-size SWA cache and guard sequences) and ~6.5k on SmolLM2-135M. Each server gets the same
``-np 8 -c C -t T -fa on``, C large enough for llama-server, whose slots share nothing (each
gets C / 8 cells), to hold the prefix in every slot.

Three rounds per server, each releasing the 8 agents at one instant:

- **cold**: nothing cached. llama-server prefills the prefix in each slot; PolyKV creates the
  pool first (its prefill is timed apart and counted into the cold first-token time) and
  every agent attaches to it;
- **resident**: new questions after the same prefix, which each server now holds (each
  llama-server slot its own copy, PolyKV the pool);
- **decode**: the resident round's answers are ``decode_tokens`` long: per-session decode
  tokens/s (after each agent's first token) and the aggregate while all 8 decode.

KV cells in use after the rounds: PolyKV's own count; llama-server's, the tokens its slots
hold. ``llama-server`` is built by ``bench/build_llama_server.sh`` from the llama.cpp tree the
engine's wheel is built from.

    python -m bench.long_prefix [--reps 1] [--models gemma-3-270m-q4_k_m,smollm2-135m-instruct-q4_1]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from . import harness as H
from . import report as R
from .engine_client import Api
from .vs_llama_server import (
    _ls_env,
    agent_body,
    agent_turn,
    llama_server_binary,
    llama_server_info,
    warm_up,
)
from .workload import word_text

NAME = "long_prefix"
AGENTS = 8
PREFIX_TOKENS = {"gemma-3-270m-q4_k_m": 16384, "smollm2-135m-instruct-q4_1": 6500}
SERVERS = ("llama_server", "polykv_pool")
LABELS = {"llama_server": "llama-server", "polykv_pool": "PolyKV, pool"}
ROUNDS = ("cold", "resident")
SUFFIX_ROOM = 256  # per agent: its question and answer


@dataclass
class Config:
    reps: int = 1
    models: tuple[str, ...] = tuple(PREFIX_TOKENS)
    threads: int = 2
    flash_attn: str = "on"
    answer_tokens: int = 8  # the cold round's answers (first-token time is what it measures)
    decode_tokens: int = 64  # the resident round's answers
    prefix_scale: float = 1.0  # --quick shrinks the prefixes

    def prefix_tokens(self, model: str) -> int:
        return max(256, int(PREFIX_TOKENS[model] * self.prefix_scale))

    def ctx(self, model: str) -> int:
        return AGENTS * (self.prefix_tokens(model) + SUFFIX_ROOM)


def common_args(cfg: Config, model: str) -> list[str]:
    return ["-np", str(AGENTS), "-c", str(cfg.ctx(model)), "-t", str(cfg.threads),
            "-fa", cfg.flash_attn]  # fmt: skip


def agent_prompts(api: Api, model: str, rep: int, n_prefix: int, rnd: str) -> list[list[int]]:
    head = "Instructions and tools shared by every agent of this team. "
    prefix = api.tokenize(head + word_text(f"{model}/prefix", n_prefix), add_special=True)
    if len(prefix) < n_prefix:
        raise H.BenchError(f"prefix text gave only {len(prefix)} tokens")
    prefix = prefix[:n_prefix]
    return [
        prefix
        + api.tokenize(
            f" Agent {i + 1}, {rnd} question: {word_text(f'{model}/{rep}/{rnd}/{i}', 14)}?",
            add_special=False,
        )
        for i in range(AGENTS)
    ]


def release(
    client: httpx.Client, base: str, prompts: Sequence[list[int]], n: int, pool: str | None
) -> list[dict[str, Any]]:
    fns = [
        (lambda i=i: agent_turn(client, base, {**agent_body(prompts[i], n, pool),
                                               "session_id": f"agent-{i}"}, 0.0))
        for i in range(AGENTS)
    ]  # fmt: skip
    H.open_connections(client, base, AGENTS)
    return H.run_together(fns, lambda: None)


def decode_rates(agents: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per-session decode tokens/s after the first token, and the aggregate over the span in
    which all of them decoded."""
    spans = [(a["first_abs"], a["done_abs"]) for a in agents]
    per = [(a["n"] - 1) / (a["done_abs"] - a["first_abs"]) for a in agents]
    decoded = sum(a["n"] - 1 for a in agents)
    return {
        "per_session_median": statistics.median(per),
        "per_session_min": min(per),
        "aggregate": decoded / H.merged_length(spans),
    }


def timed_round(
    client: httpx.Client, base: str, prompts: Sequence[list[int]], n: int, pool: str | None
) -> dict[str, Any]:
    agents = release(client, base, prompts, n, pool)
    for a in agents:  # absolute first/last token times, for the decode span
        a["first_abs"] = a["sent_s"] + a["ttft_s"]
        a["done_abs"] = a["done_s"]
        a["n"] = len(a.pop("tokens"))
    ttft = [a["ttft_s"] for a in agents]
    return {
        "ttft_median_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "cache_n": [a["cache_n"] for a in agents],
        "prompt_n": [a["prompt_n"] for a in agents],
        "decode": decode_rates(agents) if n > 1 else None,
        "agents": agents,
    }


def llama_server_runs(
    client: httpx.Client,
    binary: str,
    model: str,
    cfg: Config,
    prompts: dict[str, list[list[int]]],
) -> dict[str, Any]:
    ls = H.ServerProcess(
        "llama-server-long",
        [binary, "-m", str(H.real_model(model)), *common_args(cfg, model), "--host",
         "127.0.0.1", "--port", "{port}", "--no-webui"],
        "/health",
        env=_ls_env(binary),
    )  # fmt: skip
    out: dict[str, Any] = {"server": "llama_server", "create_s": None}
    with H.server(ls):
        warm_up(client, ls.base_url)
        for rnd in ROUNDS:
            n = cfg.answer_tokens if rnd == "cold" else cfg.decode_tokens
            out[rnd] = timed_round(client, ls.base_url, prompts[rnd], n, None)
            H.progress(f"{model} llama-server {rnd}: first token {out[rnd]['ttft_median_s']:.1f} s")
    # Its slots share no cells: KV in use is what each slot holds after its last agent.
    held = {int(a["id_slot"]): int(a["tokens_cached"]) for a in out["resident"]["agents"]}
    out["kv_cells"] = sum(held.values())
    return out


def polykv_runs(
    api: Api, model: str, cfg: Config, rep: int, prompts: dict[str, list[list[int]]]
) -> dict[str, Any]:
    api.reset(AGENTS)
    out: dict[str, Any] = {"server": "polykv_pool"}
    pool = f"long-{rep}"
    for rnd in ROUNDS:
        if rnd == "cold":
            prefix = prompts[rnd][0][: cfg.prefix_tokens(model)]
            created, out["create_s"] = api.create_pool(pool, prefix)
            if created["prefix_len"] != cfg.prefix_tokens(model):
                raise H.BenchError(f"pool prefix_len {created['prefix_len']}")
        n = cfg.answer_tokens if rnd == "cold" else cfg.decode_tokens
        out[rnd] = timed_round(api.client, api.base_url, prompts[rnd], n, pool)
        if min(out[rnd]["cache_n"]) < cfg.prefix_tokens(model):
            raise H.BenchError(f"an agent prefilled the pool's prefix again: {out[rnd]['cache_n']}")
        H.progress(f"{model} PolyKV {rnd}: first token {out[rnd]['ttft_median_s']:.1f} s")
    out["kv_cells"] = int(api.pools()["kv_cells_used"])
    api.reset(AGENTS)
    return out


def measure(cfg: Config, binary: str) -> dict[str, Any]:
    raw: dict[str, Any] = {"env": R.environment(), "llama_server": llama_server_info(binary),
                           "models": {}, "runs": []}  # fmt: skip
    for model in cfg.models:
        args = [*common_args(cfg, model), "--metrics", "--polykv-park-mib", "0"]
        with (
            H.http_client(timeout_s=3600) as client,
            H.engine("polykv-long", H.real_model(model), args) as eng,
        ):
            assert eng.proc is not None
            api = Api(client, eng.base_url, eng.proc.pid)
            warm_up(client, api.base_url)
            raw["models"][model] = {
                "prefix_tokens": cfg.prefix_tokens(model),
                "args": common_args(cfg, model),
                "memory": api.props().get("memory"),
            }
            for rep in range(cfg.reps):
                n = cfg.prefix_tokens(model)
                prompts = {rnd: agent_prompts(api, model, rep, n, rnd) for rnd in ROUNDS}
                order = SERVERS if rep % 2 == 0 else SERVERS[::-1]
                for key in order:
                    if key == "llama_server":
                        with H.paused([api.pid]):  # the engine idles apart from the run
                            run = llama_server_runs(client, binary, model, cfg, prompts)
                    else:
                        run = polykv_runs(api, model, cfg, rep, prompts)
                    raw["runs"].append({"model": model, "rep": rep, **run})
    return raw


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in raw["models"]:
        rows: dict[str, Any] = {}
        for key in SERVERS:
            runs = [r for r in raw["runs"] if r["model"] == model and r["server"] == key]
            if not runs:
                continue

            def med(get: Any, runs: list[dict[str, Any]] = runs) -> float:
                return statistics.median(float(get(r)) for r in runs)

            create = [r["create_s"] for r in runs if r.get("create_s") is not None]
            rows[key] = {
                "cold_ttft_s": med(lambda r: r["cold"]["ttft_median_s"]),
                "cold_ttft_max_s": med(lambda r: r["cold"]["ttft_max_s"]),
                "pool_create_s": statistics.median(create) if create else None,
                "resident_ttft_s": med(lambda r: r["resident"]["ttft_median_s"]),
                "resident_ttft_max_s": med(lambda r: r["resident"]["ttft_max_s"]),
                "kv_cells": med(lambda r: r["kv_cells"]),
                "decode_per_session": med(lambda r: r["resident"]["decode"]["per_session_median"]),
                "decode_aggregate": med(lambda r: r["resident"]["decode"]["aggregate"]),
            }
        out[model] = rows
    return out


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    head = ["model, prefix", "server", "cold first token (median / slowest)",
            "resident first token (median / slowest)", "KV cells", "decode tok/s per session",
            "decode tok/s, all 8"]  # fmt: skip
    rows = []
    for model, by in res.items():
        n = raw["models"][model]["prefix_tokens"]
        for key, r in by.items():
            cold = f"{r['cold_ttft_s']:.1f} / {r['cold_ttft_max_s']:.1f} s"
            if r["pool_create_s"] is not None:
                cold += f" (+ pool {r['pool_create_s']:.1f} s)"
            rows.append([
                f"{model}, {n}", LABELS[key], cold,
                f"{r['resident_ttft_s']:.2f} / {r['resident_ttft_max_s']:.2f} s",
                f"{r['kv_cells']:.0f}", f"{r['decode_per_session']:.2f}",
                f"{r['decode_aggregate']:.1f}",
            ])  # fmt: skip
    ls = raw["llama_server"]
    return "\n".join(
        [
            f"### Long shared prefixes: {AGENTS} agents, PolyKV pool vs llama-server",
            "",
            R.markdown_table(head, rows),
            "",
            f"Both servers: `-np {AGENTS} -c C -t {cfg.threads} -fa {cfg.flash_attn}` with C = "
            f"{AGENTS} x (prefix + {SUFFIX_ROOM}); llama-server {ls['version']} built from the "
            "llama.cpp tree of the engine's wheel. Cold: nothing cached (PolyKV's pool is "
            "created first, its prefill shown apart); resident: new questions after the same "
            f"prefix; decode: {cfg.decode_tokens} greedy tokens per agent in the resident round, "
            f"all 8 at once. {cfg.reps} repetition(s), medians.",
            "",
            f"{env['cpu']}, {env['cpu_count']} cores; load average at start "
            f"{env['loadavg_at_start'][0]:.2f}. Commit {env['git_commit']}, {env['date_utc']}; "
            f"`python -m bench.{NAME}`, raw numbers in `bench/results/{NAME}.json`.",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--models", default=",".join(PREFIX_TOKENS))
    p.add_argument("--decode-tokens", type=int, default=64)
    R.add_output_flags(p)
    args = p.parse_args(argv)
    models = tuple(args.models.split(","))
    if set(models) - set(PREFIX_TOKENS) or args.reps < 1:
        p.error(f"--models: a subset of {','.join(PREFIX_TOKENS)}; --reps >= 1")
    cfg = Config(reps=args.reps, models=models, decode_tokens=args.decode_tokens)
    if args.quick:
        cfg.prefix_scale, cfg.decode_tokens = 0.05, 16
    binary, why = llama_server_binary()
    if binary is None:
        H.progress(f"SKIPPED {NAME}: llama-server cannot be built on this machine. {why}")
        return 0
    return R.run_and_publish(NAME, cfg, args, lambda c: measure(c, binary), analyse, render)


if __name__ == "__main__":
    raise SystemExit(main())
