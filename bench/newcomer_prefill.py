"""A newcomer's long prompt while sessions decode: how long the decoding sessions go without a
token, and how soon the newcomer's first token comes, side by side in one run.

Servers (each repetition visits them in a rotated order; the ones not measured are stopped
with SIGSTOP so they take no CPU):

* **PolyKV, floor** — the decoding sessions attach to a pool with a floor
  (``target_tps_per_session``, advisory): the engine paces the newcomer's prompt so each step
  stays within the floor period (``policy.prefill``);
* **PolyKV, floor, per-query attention** — the same in a second engine whose ggml runs the
  paced prompt's attention on ggml's per-query kernel (every kernel path the CPU picks but
  ``fa_runs``, through ``POLYKV_GGML_PATHS``): what the tiled attention of a paced chunk
  brings, side by side;
* **PolyKV, no floor** — the same engine, the decoding sessions on a pool without a policy:
  the prompt goes in steps of up to ``n_batch`` (2,048) tokens with the decoding sessions'
  rows beside it, as the engine did before pacing ("today's"): one step at 2k, four at 8k;
* **llama-server** — upstream, built from the same llama.cpp tree
  (``bench/build_llama_server.sh``, no PolyKV patches), unified KV (``-kvu``) so the
  newcomer's context fits beside the others, the same prompts with no pool.

Workload: ``k`` sessions (4, 8) each stream a long greedy answer (EOS ignored); once every one
has decoded ``WARM_TOKENS`` and ``BASELINE_S`` more seconds passed, a newcomer sends a fresh
prompt of N tokens (2k, 8k; no cache) and streams ``NEWCOMER_TOKENS`` tokens. Streams are
read token by token (PolyKV with ``--polykv-stream-interval-ms 0``). Per run: the decoding
sessions' median gap before the arrival, their largest gap from the arrival to the
newcomer's first token (and that gap over the floor period), and the newcomer's time to first
token; PolyKV-floor ÷ PolyKV-no-floor paired per repetition.

    python -m bench.newcomer_prefill [--reps 3] [--quick]
    python -m bench.newcomer_prefill --from-json bench/results/newcomer_prefill.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from polykv_engine.llama.runtime import KERNEL_PATHS_ENV

from . import harness as H
from . import report as R
from .engine_client import Api
from .upstream import llama_server_env, llama_server_or_skip, model_path
from .workload import filler_tokens, word_text

NAME = "newcomer_prefill"
SERVERS = ("polykv_floor", "polykv_floor_perquery", "polykv_free", "llama_server")
LABELS = {
    "polykv_floor": "PolyKV, floor",
    "polykv_floor_perquery": "PolyKV, floor, per-query attention",
    "polykv_free": "PolyKV, no floor",
    "llama_server": "llama-server",
}
WARM_TOKENS = 24  # each decoding session's tokens before the clock starts
BASELINE_S = 1.5  # then this long of undisturbed decoding (the median gap before)
NEWCOMER_TOKENS = 8
DECODE_TOKENS = 100_000  # the decoding sessions run until the run ends them
PREFIX = "You are one of the agents of a team. Keep working on your part of the task. "


@dataclass
class Config:
    reps: int = 3
    model: str = "smollm2-135m-instruct-q4_1"
    decoders: tuple[int, ...] = (4, 8)
    prompt_tokens: tuple[int, ...] = (2000, 8000)
    floor_tps: float = 5.0
    threads: int = 2
    flash_attn: str = "on"
    ctx: int = 24_576
    servers: tuple[str, ...] = SERVERS


@dataclass
class Target:
    key: str
    base_url: str
    pid: int
    pool: str | None  # the pool the decoding sessions attach to (PolyKV)


def decoder_prompt(i: int) -> str:
    return f"Agent {i + 1}: {word_text(f'decoder/{i}', 16)}. Write the report, line by line:"


def newcomer_prompt(api: Api, n_tokens: int, rep: int) -> list[int]:
    """A fresh prompt of exactly ``n_tokens`` (a new one per repetition: nothing cached)."""
    return filler_tokens(api, f"Tool result {rep}: ", f"newcomer/{n_tokens}/{rep}", n_tokens)


def stream_tokens(
    client: httpx.Client, base: str, body: dict[str, Any], times: list[float], stop: threading.Event
) -> None:
    """Stream ``body``; append each token's arrival time to ``times`` until ``stop``."""
    for now, ev in H.sse_events(client, f"{base}/completion", body):
        times.extend([now] * len(ev.get("tokens") or []))
        if stop.is_set() or ev.get("stop"):
            return


def wait_idle(client: httpx.Client, base: str, limit_s: float = 120.0) -> None:
    """Until the server has no request running (closed streams cancel theirs)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        r = client.get(f"{base}/slots")
        if r.status_code != 200 or not any(s.get("is_processing") for s in r.json()):
            return
        time.sleep(0.2)
    raise H.BenchError(f"{base}: still processing {limit_s:.0f} s after the run")


def one_run(
    client: httpx.Client, target: Target, decoders: Sequence[list[int]], prompt: list[int]
) -> dict[str, Any]:
    k = len(decoders)
    stop = threading.Event()
    times: list[list[float]] = [[] for _ in range(k)]
    errors: list[BaseException] = []

    def decoder(i: int, tokens: list[int]) -> None:
        body: dict[str, Any] = {
            "prompt": tokens, "n_predict": DECODE_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "cache_prompt": False,
        }  # fmt: skip
        if target.pool is not None:
            body["pool_id"] = target.pool
            body["cache_prompt"] = True  # the pool's cells; the rest is new
        try:
            stream_tokens(client, target.base_url, body, times[i], stop)
        except BaseException as exc:  # reported after the run
            errors.append(exc)

    threads = [
        threading.Thread(target=decoder, args=(i, tokens), daemon=True)
        for i, tokens in enumerate(decoders)
    ]
    H.open_connections(client, target.base_url, k + 1)
    with H.CpuWatch([target.pid]) as cpu:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while min(len(x) for x in times) < WARM_TOKENS:
            if errors or time.monotonic() > deadline:
                stop.set()
                raise H.BenchError(f"{target.key}: decoding sessions did not start: {errors}")
            time.sleep(0.02)
        time.sleep(BASELINE_S)
        newcomer: list[float] = []
        body = {"prompt": prompt, "n_predict": NEWCOMER_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "cache_prompt": False}  # fmt: skip
        t_send = time.perf_counter()
        stream_tokens(client, target.base_url, body, newcomer, threading.Event())
        time.sleep(0.5)  # the decoders' next tokens after the newcomer's first
        stop.set()
        for t in threads:
            t.join(60)
    wait_idle(client, target.base_url)
    if errors:
        raise H.BenchError(f"{target.key}: a decoding session failed: {errors[0]}")
    t_first = newcomer[0]
    before = [b - a for ts in times for a, b in itertools.pairwise(ts) if b < t_send]
    # Each session's longest wait for a token from the arrival until its first token after
    # the newcomer's first: the whole prefill lies inside that window.
    during: list[tuple[float, float]] = []  # (longest gap, when it began after the arrival)
    gaps: list[float] = []  # every gap in those windows: the rate the sessions kept
    for ts in times:
        after = [t for t in ts if t > t_send]
        window = [t_send] + [t for t in after if t <= t_first]
        window += [t for t in after if t > t_first][:1]
        during.append(max((b - a, a - t_send) for a, b in itertools.pairwise(window)))
        gaps += [b - a for a, b in itertools.pairwise(window[1:])]
    longest = max(during)
    return {
        "ttft_s": t_first - t_send,
        "gap_before_median_s": statistics.median(before),
        "gap_during_max_s": longest[0],
        "gap_during_max_began_s": longest[1],  # after the arrival: where to look for its cause
        "gap_during_median_s": statistics.median(gaps) if gaps else None,
        "gap_during_per_session_s": [gap for gap, _ in during],
        "foreign_cpu_cores": cpu.foreign_cores,
    }


@contextlib.contextmanager
def targets(
    cfg: Config, binary: str | None, model: Path
) -> Iterator[tuple[list[Target], Api, list[list[int]]]]:
    """The servers, the engine's API (its tokenizer), and the decoding sessions' prompts."""
    common = ["-np", str(max(cfg.decoders) + 1), "-c", str(cfg.ctx), "-t", str(cfg.threads),
              "-fa", cfg.flash_attn]  # fmt: skip
    engine_args = [*common, "--metrics", "--polykv-stream-interval-ms", "0"]
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(H.http_client())
        eng = stack.enter_context(H.engine("polykv-newcomer", model, engine_args))
        assert eng.proc is not None
        api = Api(client, eng.base_url, eng.proc.pid)
        prefix = api.tokenize(PREFIX, add_special=True)
        floor = {"target_tps_per_session": cfg.floor_tps, "mode": "advisory"}
        for name in ("crew-floor", "crew-free"):
            api.create_pool(name, prefix)
        api.post("/polykv/pools/crew-floor/admission", floor)
        decoders = [
            prefix + api.tokenize(" " + decoder_prompt(i), add_special=False)
            for i in range(max(cfg.decoders))
        ]
        tgts = [
            Target("polykv_floor", eng.base_url, eng.proc.pid, "crew-floor"),
            Target("polykv_free", eng.base_url, eng.proc.pid, "crew-free"),
        ]
        if "polykv_floor_perquery" in cfg.servers:
            paths = api.get("/props")["polykv"]["cpu_backend"]["kernel_paths"]
            env = {**H.SERVER_ENV, KERNEL_PATHS_ENV: ",".join(p for p in paths if p != "fa_runs")}
            with H.paused([eng.proc.pid]):
                pq = stack.enter_context(
                    H.engine("polykv-newcomer-perquery", model, engine_args, env=env)
                )
            assert pq.proc is not None
            pq_api = Api(client, pq.base_url, pq.proc.pid)
            pq_api.create_pool("crew-floor", prefix)
            pq_api.post("/polykv/pools/crew-floor/admission", floor)
            tgts.insert(1, Target("polykv_floor_perquery", pq.base_url, pq.proc.pid, "crew-floor"))
        if binary is not None:
            argv = [binary, "-m", str(model), *common, "-kvu", "--host", "127.0.0.1",
                    "--port", "{port}", "--no-webui"]  # fmt: skip
            env = llama_server_env(binary)
            ls = H.ServerProcess("llama-server-newcomer", argv, "/health", env=env)
            stack.enter_context(H.server(ls))
            tgts.append(Target("llama_server", ls.base_url, ls.pid, None))
        yield [t for t in tgts if t.key in cfg.servers], api, decoders


def measure(cfg: Config, binary: str | None) -> dict[str, Any]:
    raw: dict[str, Any] = {"env": R.environment(), "runs": []}
    model = model_path(cfg.model)
    with targets(cfg, binary, model) as (tgts, api, decoders):
        pids = {t.pid for t in tgts}
        for rep in range(cfg.reps):
            order = tgts[rep % len(tgts) :] + tgts[: rep % len(tgts)]
            for n in cfg.prompt_tokens:
                prompt = newcomer_prompt(api, n, rep)
                for k in cfg.decoders:
                    for tgt in order:
                        with H.paused([p for p in pids if p != tgt.pid]):
                            # llama-server gets the same tokens, its decoders no pool.
                            run = one_run(api.client, tgt, decoders[:k], prompt)
                        H.progress(
                            f"rep {rep + 1}/{cfg.reps} {n} tokens, {k} decoding, "
                            f"{LABELS[tgt.key]:<17} first token {run['ttft_s']:6.2f} s, "
                            f"largest gap {run['gap_during_max_s']:6.2f} s "
                            f"{run['gap_during_max_began_s']:.1f} s in (before: "
                            f"{1e3 * run['gap_before_median_s']:.0f} ms)"
                        )
                        raw["runs"].append(
                            {"rep": rep, "prompt_tokens": n, "k": k, "server": tgt.key, **run}
                        )
    return raw


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    runs = raw["runs"]
    period = 1.0 / cfg.floor_tps
    out: dict[str, Any] = {}
    for n in cfg.prompt_tokens:
        for k in cfg.decoders:

            def of(key: str, n: int = n, k: int = k) -> dict[int, dict[str, Any]]:
                return {
                    r["rep"]: r
                    for r in runs
                    if r["prompt_tokens"] == n and r["k"] == k and r["server"] == key
                }

            row: dict[str, Any] = {}
            for key in SERVERS:
                rs = list(of(key).values())
                if not rs:
                    continue
                during = [
                    1.0 / r["gap_during_median_s"] for r in rs if r.get("gap_during_median_s")
                ]
                row[key] = {
                    "ttft_s": H.summarize([r["ttft_s"] for r in rs]).as_dict(),
                    "gap_max_s": H.summarize([r["gap_during_max_s"] for r in rs]).as_dict(),
                    "gap_max_periods": H.summarize(
                        [r["gap_during_max_s"] / period for r in rs]
                    ).as_dict(),
                    "gap_before_s": H.summarize([r["gap_before_median_s"] for r in rs]).as_dict(),
                    # the rate the decoding sessions kept while the prompt went in (runs
                    # before 2026-12-07 did not record it)
                    "tps_during": H.summarize(during).as_dict() if during else None,
                    "foreign_cpu_cores": H.summarize(
                        [r["foreign_cpu_cores"] for r in rs]
                    ).as_dict(),
                }
            floor, free = of("polykv_floor"), of("polykv_free")
            pairs = [(floor[i], free[i]) for i in floor if i in free]
            if pairs:
                row["ttft_vs_no_floor"] = H.summarize(
                    [a["ttft_s"] / b["ttft_s"] for a, b in pairs]
                ).as_dict()
            out[f"{n}/{k}"] = row
    return out


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    period_ms = 1e3 / cfg.floor_tps
    ls_build = (
        "llama-server: upstream, built from the same llama.cpp tree without PolyKV's kernel "
        "patches, `-kvu`"
        if "llama_server" in cfg.servers
        else "llama-server not run this time (`--servers`)"
    )
    perquery = (
        "PolyKV, floor, per-query attention: a second engine, paced as the first, whose ggml "
        "runs the prompt chunks' attention on its per-query kernel (kernel path `fa_runs` off); "
        if "polykv_floor_perquery" in cfg.servers
        else ""
    )
    lines = [
        f"### A newcomer's prompt while sessions decode ({cfg.model}, floor "
        f"{cfg.floor_tps:g} tok/s)",
        "",
        f"k sessions decode; a newcomer sends a fresh prompt of N tokens. *Largest gap*: the "
        f"longest any decoding session waited for a token between the arrival and its first "
        f"token after the newcomer's, in floor periods ({period_ms:.0f} ms; the target is "
        f"≤ 1.5). *Their rate during it*: one over the median of those waits, the rate the "
        f"sessions kept while the paced prompt went in (the floor: {cfg.floor_tps:g} tok/s). "
        f"*First token*: the newcomer's. PolyKV, floor: the sessions' pool has the floor "
        f"and the engine paces the prompt; PolyKV, no floor: the same engine, the prompt in "
        f"steps of up to 2,048 tokens (the engine's default `-b`; the engine before pacing); "
        f"{perquery}all on PolyKV's llama-cpp-python "
        f"{env.get('llama_cpp_python', '?')} wheel with its ggml patches; {ls_build}. "
        f"Median (min–max) of "
        f"{cfg.reps} repetitions, the servers alternating; `-np {max(cfg.decoders) + 1} -c "
        f"{cfg.ctx} -t {cfg.threads} -fa {cfg.flash_attn}`, greedy, streams read token by "
        f"token.",
        "",
    ]
    headers = ["N tokens, k decoding", "gap before"]
    for key in cfg.servers:
        headers += [f"{LABELS[key]}: largest gap", "first token"]
        if key == "polykv_floor":
            headers.append("their rate during it")
    headers.append("first token, floor ÷ no floor")
    rows = []
    for n in cfg.prompt_tokens:
        for k in cfg.decoders:
            row = res.get(f"{n}/{k}") or {}
            before = (row.get("polykv_free") or {}).get("gap_before_s")
            cells = [f"{n}, {k}", R.fmt(before, 0, 1e3, " ms")]
            for key in cfg.servers:
                c = row.get(key) or {}
                gap = c.get("gap_max_s")
                periods = c.get("gap_max_periods")
                cells.append(f"{R.fmt(gap, 2, 1, ' s')} ({R.med(periods, 1)}×)" if gap else "–")
                cells.append(R.fmt(c.get("ttft_s"), 1, 1, " s"))
                if key == "polykv_floor":
                    cells.append(R.fmt(c.get("tps_during"), 1, 1, " tok/s"))
            cells.append(R.fmt(row.get("ttft_vs_no_floor"), 2, 1, "×"))
            rows.append(cells)
    lines.append(R.markdown_table(headers, rows))
    foreign = [r["foreign_cpu_cores"] for r in raw["runs"]]
    lines += [
        "",
        R.provenance(NAME, env, foreign),
    ]
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default=Config.model)
    p.add_argument("--decoders", type=_ints, default=Config.decoders)
    p.add_argument("--prompt-tokens", type=_ints, default=Config.prompt_tokens)
    p.add_argument("--floor-tps", type=float, default=Config.floor_tps)
    p.add_argument("--servers", default=",".join(SERVERS), help=f"a subset of {','.join(SERVERS)}")
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render)) is not None:
        return rc
    cfg = Config(
        reps=args.reps,
        model=args.model,
        decoders=args.decoders,
        prompt_tokens=args.prompt_tokens,
        floor_tps=args.floor_tps,
        servers=tuple(x for x in SERVERS if x in args.servers.split(",")),
    )
    if args.quick:
        cfg.reps, cfg.decoders, cfg.prompt_tokens = 1, (4,), (1000,)
    if cfg.reps < 1 or not cfg.decoders or not cfg.prompt_tokens or cfg.floor_tps <= 0:
        p.error("--reps >= 1, --decoders and --prompt-tokens non-empty, --floor-tps > 0")
    if not cfg.servers:
        p.error(f"--servers: a subset of {','.join(SERVERS)}")
    binary = llama_server_or_skip(NAME) if "llama_server" in cfg.servers else None
    if binary is None and "llama_server" in cfg.servers:
        return 0
    return R.run_and_publish(NAME, cfg, args, lambda c: measure(c, binary), analyse, render)


if __name__ == "__main__":
    raise SystemExit(main())
