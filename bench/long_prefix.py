"""Long shared prefixes, 8 agents: PolyKV against upstream llama-server on the same model and
flags, side by side in one run.

Agent harnesses send 10-30k tokens before the first user word. Here 8 agents share one long
prefix: 16k tokens on Gemma 3 270M (a sliding-window model) and 6.5k on SmolLM2-135M. Both
servers get ``-np 8 -c C -t T -fa on``, C large enough for llama-server, whose slots share
nothing (an explicit ``-np`` splits its cache into C / 8 cells a slot), to hold the prefix in
every slot. llama-server is built by ``bench/build_llama_server.sh`` from the llama.cpp tree
the engine's wheel is built from, without the wheel's kernel patches.

Each repetition starts a fresh llama-server (no slot, no host-memory prompt cache holds
anything) and erases every slot and pool of the engine, then releases the 8 agents at one
instant, server by server (the one not measured is stopped with SIGSTOP):

- **cold**: nothing cached. llama-server prefills the prefix in every slot. PolyKV twice: with
  automatic sharing (no pool named: what an agent CLI sends), and with the prefix a pool,
  created first (its build is timed apart and added to the agents' first-token time) and
  attached by ``pool_id``;
- **resident** (``--rounds`` times, the servers' order alternating): new questions after the
  same prefix, which each server now holds (each llama-server slot its own copy, PolyKV the
  pool). Their ``decode_tokens``-long answers give the decode rates, counted over the span in
  which all 8 agents decode: each agent's tokens in it, and their sum.

KV cells in use after the last round: PolyKV's own count; llama-server's, the tokens its
slots hold (they share no cells). The cores other processes used during each round are
recorded: the machine is shared.

    python -m bench.long_prefix [--reps 1] [--rounds 3] [--models a,b] [--quick]
    python -m bench.long_prefix --from-json bench/results/long_prefix.json
    python -m bench.long_prefix --models gemma-3-270m-q4_k_m --keep-models-from OLD.json

One model's run takes long (the Gemma 3 rows: llama-server prefills 8 x 16k tokens), so
``--keep-models-from`` keeps the rows of the models a run did not measure from an earlier
results file, each said to be from that run, with its own machine, load, commit and config.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from . import harness as H
from . import report as R
from . import upstream as U
from .engine_client import Api, Turn, stream_turn
from .workload import SUFFIX_MAX, Workload, make_workload

NAME = "long_prefix"
AGENTS = 8
PREFIX_TOKENS = {"gemma-3-270m-q4_k_m": 16384, "smollm2-135m-instruct-q4_1": 6500}
SERVERS = ("llama_server", "polykv_auto", "polykv_pool")
LABELS = {
    "llama_server": "llama-server",
    "polykv_auto": "PolyKV, automatic sharing",
    "polykv_pool": "PolyKV, pool",
}
RESIDENT = ("llama_server", "polykv_pool")  # the servers of the resident rounds
SUFFIX_ROOM = 256  # per agent: its question (at most SUFFIX_MAX tokens) and answer


@dataclass
class Config:
    reps: int = 1  # cold rounds per server: each is one 8 x prefix prefill on llama-server
    rounds: int = 3  # resident rounds per repetition
    models: tuple[str, ...] = tuple(PREFIX_TOKENS)
    threads: int = 2
    flash_attn: str = "on"
    cold_tokens: int = 8  # the cold round's answers (its first-token time is what it measures)
    decode_tokens: int = 64  # the resident rounds' answers
    prefix_scale: float = 1.0  # --quick shrinks the prefixes
    servers: tuple[str, ...] = SERVERS  # the columns measured

    def prefix_tokens(self, model: str) -> int:
        return max(256, int(PREFIX_TOKENS[model] * self.prefix_scale))

    def ctx(self, model: str) -> int:
        return AGENTS * (self.prefix_tokens(model) + SUFFIX_ROOM)


@dataclass(frozen=True, slots=True)
class Target:
    key: str
    base_url: str
    pid: int


def common_args(cfg: Config, model: str) -> list[str]:
    return ["-np", str(AGENTS), "-c", str(cfg.ctx(model)), "-t", str(cfg.threads),
            "-fa", cfg.flash_attn]  # fmt: skip


def bodies(tgt: Target, prompts: Sequence[list[int]], n: int, pool: str | None) -> list[Any]:
    """The agents' requests: greedy, EOS ignored; llama-server's agent i on its slot i (a
    resident round then finds its own copy of the prefix there), PolyKV's as session i."""
    out = []
    for i, prompt in enumerate(prompts):
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "cache_prompt": True,
        }
        if tgt.key == "llama_server":
            body["id_slot"] = i
        else:
            body["session_id"] = f"agent-{i}"
        if pool is not None:
            body["pool_id"] = pool
        out.append(body)
    return out


def decode_rates(turns: Sequence[Turn]) -> dict[str, float] | None:
    """Tokens/s over the span in which every agent decodes (from the last first token to the
    first last token): each agent's, and their sum. None when the spans do not overlap."""
    lo = max(t.token_times[0] for t in turns)
    hi = min(t.token_times[-1] for t in turns)
    if hi <= lo:
        return None
    per = [sum(lo < x <= hi for x in t.token_times) / (hi - lo) for t in turns]
    return {
        "window_s": hi - lo,
        "per_session_median": statistics.median(per),
        "per_session_min": min(per),
        "aggregate": sum(per),
    }


def timed_round(
    client: httpx.Client, tgt: Target, prompts: Sequence[list[int]], n: int, pool: str | None
) -> dict[str, Any]:
    """The agents released at one instant on ``tgt``; what each saw, and the other load."""
    fns = [functools.partial(stream_turn, client, tgt.base_url, b)
           for b in bodies(tgt, prompts, n, pool)]  # fmt: skip
    H.open_connections(client, tgt.base_url, AGENTS)
    with H.CpuWatch([tgt.pid]) as cpu:
        turns = H.run_together(fns, lambda: None)
    for t in turns:
        if len(t.token_times) != n:
            raise H.BenchError(f"{tgt.key}: {len(t.token_times)} tokens streamed, {n} asked")
    ttft = [t.ttft_s for t in turns]
    return {
        "ttft_median_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "cache_n": [int(t.timings["cache_n"]) for t in turns],
        "prompt_n": [int(t.timings["prompt_n"]) for t in turns],
        "slot_tokens": {int(t.final["id_slot"]): int(t.final["tokens_cached"]) for t in turns},
        "decode": decode_rates(turns) if n > 1 else None,
        "foreign_cores": cpu.foreign_cores,
    }


def warm_up(client: httpx.Client, base_url: str) -> None:
    """One tiny request before anything is timed (no token in common with the agents')."""
    body = {"prompt": "Hello", "n_predict": 1, "cache_prompt": False, "stream": True}
    stream_turn(client, base_url, body)


def one_rep(
    client: httpx.Client,
    api: Api,
    binary: str | None,
    model: str,
    cfg: Config,
    wl: Workload,
    rep: int,
) -> list[dict[str, Any]]:
    n = cfg.prefix_tokens(model)

    def prompts(tag: str) -> list[list[int]]:
        return [wl.prefix + s for s in wl.suffixes(rep, AGENTS, tag)]

    runs: list[dict[str, Any]] = []

    def record(key: str, rnd: str, run: dict[str, Any]) -> None:
        runs.append({"model": model, "rep": rep, "server": key, "round": rnd, **run})
        H.progress(
            f"{model} rep {rep + 1} {rnd:<10} {LABELS[key]:<26} first token "
            f"{run['ttft_median_s']:7.2f} s (slowest {run['ttft_max_s']:.2f}), other load "
            f"{run['foreign_cores']:.2f} cores"
        )

    api.reset(AGENTS)
    with contextlib.ExitStack() as stack:
        tgts = {key: Target(key, api.base_url, api.pid) for key in ("polykv_auto", "polykv_pool")}
        if binary is not None:
            argv = [binary, "-m", str(U.model_path(model)), *common_args(cfg, model), "--host",
                    "127.0.0.1", "--port", "{port}", "--no-webui"]  # fmt: skip
            env = U.llama_server_env(binary)
            ls = H.ServerProcess("llama-server-long", argv, "/health", env=env)
            stack.enter_context(H.server(ls))
            warm_up(client, ls.base_url)
            tgts["llama_server"] = Target("llama_server", ls.base_url, ls.pid)
        pids = {t.pid for t in tgts.values()}

        def alone(key: str) -> Any:
            return H.paused([p for p in pids if p != tgts[key].pid])

        pool = f"long-{rep}"
        cold = [k for k in (SERVERS if rep % 2 == 0 else SERVERS[::-1]) if k in cfg.servers]
        for key in cold:
            with alone(key):
                if key == "llama_server":
                    run = timed_round(client, tgts[key], prompts("cold"), cfg.cold_tokens, None)
                elif key == "polykv_auto":
                    api.reset(AGENTS)
                    run = timed_round(client, tgts[key], prompts("cold"), cfg.cold_tokens, None)
                    run["kv_cells"] = int(api.pools()["kv_cells_used"])
                else:
                    api.reset(AGENTS)
                    created, run_create = api.create_pool(pool, wl.prefix)
                    if created["prefix_len"] != n:
                        raise H.BenchError(f"pool prefix_len {created['prefix_len']}, not {n}")
                    run = timed_round(client, tgts[key], prompts("cold"), cfg.cold_tokens, pool)
                    run["pool_create_s"] = run_create
                    if min(run["cache_n"]) < n:
                        raise H.BenchError(f"an agent computed the pool again: {run['cache_n']}")
            record(key, "cold", run)
        order = [k for k in cold if k in RESIDENT]
        for r in range(cfg.rounds):
            for key in order if r % 2 == 0 else order[::-1]:
                name = pool if key == "polykv_pool" else None
                with alone(key):
                    run = timed_round(client, tgts[key], prompts(f"resident-{r}"),
                                      cfg.decode_tokens, name)  # fmt: skip
                if key == "polykv_pool":
                    run["kv_cells"] = int(api.pools()["kv_cells_used"])
                else:  # its slots share no cells: what each holds after its agent
                    run["kv_cells"] = sum(run["slot_tokens"].values())
                record(key, f"resident-{r}", run)
    return runs


def measure(cfg: Config, binary: str | None) -> dict[str, Any]:
    """``binary``: llama-server's, None when its column is not measured."""
    raw: dict[str, Any] = {
        "env": R.environment(),
        "llama_server": U.llama_server_info(binary) if binary is not None else None,
        "polykv_patches": list(_patches()),
        "models": {},
        "runs": [],
    }
    for model in cfg.models:
        n = cfg.prefix_tokens(model)
        args = [*common_args(cfg, model), "--metrics", "--polykv-park-mib", "0",
                "--polykv-stream-interval-ms", "0"]  # fmt: skip
        with (
            H.http_client(timeout_s=7200) as client,
            H.engine("polykv-long", U.model_path(model), args) as eng,
        ):
            assert eng.proc is not None
            api = Api(client, eng.base_url, eng.proc.pid)
            warm_up(client, api.base_url)
            wl = make_workload(api, n, AGENTS * SUFFIX_MAX * (1 + cfg.rounds) * cfg.reps)
            raw["models"][model] = {"prefix_tokens": n, "args": common_args(cfg, model),
                                    "memory": api.props().get("memory")}  # fmt: skip
            for rep in range(cfg.reps):
                raw["runs"] += one_rep(client, api, binary, model, cfg, wl, rep)
    return raw


def _patches() -> tuple[str, ...]:
    from polykv_engine.llama.runtime import build_patches

    return build_patches()


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in raw["models"]:
        rows: dict[str, Any] = {}
        for key in SERVERS:
            runs = [r for r in raw["runs"] if r["model"] == model and r["server"] == key]
            if not runs:
                continue
            cold = [r for r in runs if r["round"] == "cold"]
            resident = [r for r in runs if r["round"] != "cold"]
            decode = [r["decode"] for r in resident if r["decode"] is not None]

            def summ(values: Sequence[float]) -> dict[str, Any] | None:
                return H.summarize(values).as_dict() if values else None

            build = [r["pool_create_s"] for r in cold if "pool_create_s" in r]
            # A pool's build comes before its agents: counted into their first token.
            first = [r["ttft_median_s"] + r.get("pool_create_s", 0.0) for r in cold]
            slowest = [r["ttft_max_s"] + r.get("pool_create_s", 0.0) for r in cold]
            rows[key] = {
                "cold_ttft_s": summ(first),
                "cold_ttft_max_s": summ(slowest),
                "pool_create_s": summ(build),
                "cold_cache_n_min": min(min(r["cache_n"]) for r in cold),
                "resident_ttft_s": summ([r["ttft_median_s"] for r in resident]),
                "resident_ttft_max_s": summ([r["ttft_max_s"] for r in resident]),
                "kv_cells": summ([r["kv_cells"] for r in runs if "kv_cells" in r]),
                "decode_per_session": summ([d["per_session_median"] for d in decode]),
                "decode_aggregate": summ([d["aggregate"] for d in decode]),
                "foreign_cores": summ([r["foreign_cores"] for r in runs]),
            }
        out[model] = rows
    return out


def keep_models(raw: dict[str, Any], older: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the models of `older` (a results file) it lacks: their runs, and the
    environment, llama-server and config of the run that measured them."""
    kept = {m: v for m, v in older["models"].items() if m not in raw["models"]}
    for model, entry in kept.items():
        earlier = {k: older.get(k) for k in ("env", "llama_server", "config", "polykv_patches")}
        raw["models"][model] = {**entry, "earlier_run": entry.get("earlier_run") or earlier}
    raw["runs"] += [r for r in older["runs"] if r["model"] in kept]
    return raw


def _earlier_run(model: str, earlier: dict[str, Any]) -> str:
    c = earlier["config"]
    return (
        f"The {model} rows come from an earlier run ({c['reps']} cold and "
        f"{c['reps'] * c['rounds']} resident round(s), {c['decode_tokens']}-token answers, "
        f"llama-server {earlier['llama_server']['version']}): " + R.provenance(NAME, earlier["env"])
    )


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env, ls = raw["env"], raw["llama_server"]
    head = ["model, prefix tokens", "server", "cold first token, s",
            "resident first token, s", "KV cells", "decode tok/s per session",
            "decode tok/s, all 8", "other load, cores"]  # fmt: skip
    rows = []
    for model, by in res.items():
        n = raw["models"][model]["prefix_tokens"]
        for key, r in by.items():
            cold = f"{R.fmt(r['cold_ttft_s'], 1)}; slowest {R.med(r['cold_ttft_max_s'], 1)}"
            if r["pool_create_s"] is not None:
                cold += f" (pool build {R.med(r['pool_create_s'], 1)} of it)"
            resident = "–"
            if r["resident_ttft_s"] is not None:
                slowest = R.med(r["resident_ttft_max_s"], 2)
                resident = f"{R.fmt(r['resident_ttft_s'], 2)}; slowest {slowest}"
            rows.append([
                f"{model}, {n}", LABELS[key], cold, resident, R.fmt(r["kv_cells"]),
                R.fmt(r["decode_per_session"], 2), R.fmt(r["decode_aggregate"], 1),
                R.fmt(r["foreign_cores"], 2),
            ])  # fmt: skip
    patches = ", ".join(raw.get("polykv_patches") or ()) or "none"
    upstream = (
        f"llama-server {ls['version']}, built by `bench/build_llama_server.sh` from the "
        "llama.cpp tree of the engine's wheel without its patches, a fresh process per "
        "repetition"
        if ls is not None
        else "llama-server not run in this run (`--servers`)"
    )
    return "\n".join(
        [
            f"### Long shared prefixes: {AGENTS} agents, PolyKV vs llama-server",
            "",
            R.markdown_table(head, rows),
            "",
            f"Both servers: `-np {AGENTS} -c C -t {cfg.threads} -fa {cfg.flash_attn}`, C = "
            f"{AGENTS} x (prefix + {SUFFIX_ROOM}); greedy, EOS ignored. {upstream}; PolyKV "
            f"on llama-cpp-python {env['llama_cpp_python']} with patches: {patches} "
            "(`--polykv-park-mib 0 --polykv-stream-interval-ms 0`). *Cold*: nothing cached; "
            f"{cfg.cold_tokens}-token answers; the pool column counts its build (before the "
            "agents) in. *Resident*: new questions after the same prefix, each server holding "
            f"it; {cfg.decode_tokens}-token answers, decode rates over the span in which all 8 "
            "decode. *KV cells*: after the round (llama-server: the tokens its slots hold). "
            f"*Other load*: cores other processes used during the rounds. Median (min–max) of "
            f"{cfg.reps} cold and {cfg.reps * cfg.rounds} resident round(s) per server, the "
            "servers alternating, the one not measured stopped (SIGSTOP).",
            "",
            R.provenance(NAME, env),
            *[
                f"\n{_earlier_run(m, v['earlier_run'])}"
                for m, v in raw["models"].items()
                if v.get("earlier_run")
            ],
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default=",".join(PREFIX_TOKENS))
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--servers", default=",".join(SERVERS), help="the columns measured")
    p.add_argument("--prefix-scale", type=float, default=1.0, help="the prefixes, scaled")
    p.add_argument(
        "--keep-models-from",
        type=Path,
        help="a results file: the rows of its models this run lacks are kept, as its own",
    )
    R.add_output_flags(p)
    args = p.parse_args(argv)
    older = json.loads(args.keep_models_from.read_text()) if args.keep_models_from else None

    def with_older(raw: dict[str, Any]) -> dict[str, Any]:
        return keep_models(raw, older) if older is not None else raw

    replayed = R.from_json(NAME, args, Config, analyse, render, transform=with_older)
    if replayed is not None:
        return replayed
    models = tuple(args.models.split(","))
    servers = tuple(k for k in SERVERS if k in args.servers.split(","))
    if set(models) - set(PREFIX_TOKENS) or args.reps < 1 or args.rounds < 1:
        p.error(f"--models: a subset of {','.join(PREFIX_TOKENS)}; --reps, --rounds >= 1")
    if set(args.servers.split(",")) - set(SERVERS) or not 0 < args.prefix_scale <= 1:
        p.error(f"--servers: a subset of {','.join(SERVERS)}; 0 < --prefix-scale <= 1")
    cfg = Config(args.reps, args.rounds, models, decode_tokens=args.decode_tokens,
                 prefix_scale=args.prefix_scale, servers=servers)  # fmt: skip
    if args.quick:
        cfg.prefix_scale, cfg.rounds, cfg.decode_tokens = 0.05, 1, 16
    binary = U.llama_server_or_skip(NAME) if "llama_server" in servers else None
    if binary is None and "llama_server" in servers:
        return 0
    return R.run_and_publish(
        NAME, cfg, args, lambda c: with_older(measure(c, binary)), analyse, render
    )


if __name__ == "__main__":
    raise SystemExit(main())
