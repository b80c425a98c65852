"""PolyKV's patched kernel paths on and off, against upstream llama-server, in one run.

The engine's wheel carries batched kernels for weight types ggml has no batched path for on
x86 (scripts/patches: Q4_1, Q4_K_M's repacked Q4_K and its Q6_K, and Q5_1), and 512-bit ones
for Q5_0 and Q8_0 (which llamafile's tinyBLAS batches in 256-bit registers), gated per CPU
family by ggml-cpu-paths.patch. This runs, per model, three servers with the same flags: upstream
llama-server built from the same llama.cpp tree without the patches, PolyKV with the paths its
gate picks for this CPU, and PolyKV with every path off (``POLYKV_GGML_PATHS=none``, ggml's
own kernels). k streams decode greedy answers at once; the servers take turns (the others
stopped), in rotated order per repetition, and ratios are paired per repetition. The table
names the CPU: a path is on only where a table like this one measured it to win.

    python -m bench.kernel_paths [--reps 3] [--models smollm2-135m-instruct-q4_k_m,...]
    python -m bench.kernel_paths --from-json bench/results/kernel_paths.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import harness as H
from . import report as R
from . import upstream as U
from .vs_llama_server import OMP_VARS, prompt, stream, streams_agree

NAME = "kernel_paths"
PATHS_ENV = "POLYKV_GGML_PATHS"
SERVERS = ("llama_server", "polykv", "polykv_ggml")
LABELS = {
    "llama_server": "llama-server",
    "polykv": "PolyKV, paths on",
    "polykv_ggml": "PolyKV, paths off",
}


@dataclass
class Config:
    reps: int = 3
    models: tuple[str, ...] = (
        "smollm2-135m-instruct-q4_k_m",
        "smollm2-135m-instruct-q4_1",
        "smollm2-135m-instruct-q5_1",
        "smollm2-135m-instruct-q8_0",
    )
    levels: tuple[int, ...] = (1, 2, 4, 8)
    n_predict: int = 96
    threads: int = 2
    flash_attn: str = "on"
    on: str | None = None  # POLYKV_GGML_PATHS for "paths on"; None: the gate's choice


def common_args(cfg: Config) -> list[str]:
    n = max(cfg.levels)
    return ["-np", str(n), "-c", str(n * 512), "-t", str(cfg.threads), "-fa", cfg.flash_attn]


def decode(base_url: str, cfg: Config, model: str, rep: int, k: int) -> dict[str, Any]:
    """k streams released together; the decode rate over the span in which they decode."""
    with H.http_client() as client:
        H.open_connections(client, base_url, k)
        fns = [
            (lambda i=i: stream(client, base_url, prompt(model, rep, k, i), cfg.n_predict))
            for i in range(k)
        ]
        runs = H.run_together(fns, lambda: None)
    spans = [(r.t_first, r.t_last) for r in runs]
    decoded = sum(r.n_decoded - 1 for r in runs)
    return {
        "decode_tps": decoded / H.merged_length(spans),
        "tokens": [r.tokens for r in runs],
        "texts": [r.text for r in runs],
    }


def same_streams(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two runs' streams all agree (``streams_agree``: by text where one lacks ids)."""
    return all(streams_agree(a["tokens"], b["tokens"], a.get("texts"), b.get("texts")))


def measure_model(cfg: Config, binary: str, model: str, raw: dict[str, Any]) -> None:
    path = U.model_path(model)
    common = common_args(cfg)
    with contextlib.ExitStack() as stack, H.http_client() as client:
        pids: dict[str, int] = {}
        urls: dict[str, str] = {}
        argv = [binary, "-m", str(path), *common, "--host", "127.0.0.1", "--port", "{port}",
                "--no-webui"]  # fmt: skip
        # Every server with the harness's OpenMP wait policy (H.SERVER_ENV), nothing inherited.
        ls_env = {**U.llama_server_env(binary), **H.SERVER_ENV}
        ls = H.ServerProcess("llama-server-paths", argv, "/health", env=ls_env)
        stack.enter_context(H.server(ls))
        pids["llama_server"], urls["llama_server"] = ls.pid, ls.base_url
        paths: dict[str, list[str]] = {}
        on = {PATHS_ENV: cfg.on} if cfg.on else {}
        for key, extra in (("polykv", on), ("polykv_ggml", {PATHS_ENV: "none"})):
            eng = stack.enter_context(
                H.engine(f"polykv-{key}", path, common, {**H.SERVER_ENV, **extra})
            )
            assert eng.proc is not None
            pids[key], urls[key] = eng.proc.pid, eng.base_url
            backend = client.get(f"{eng.base_url}/props").json()["polykv"]["cpu_backend"]
            paths[key] = backend["kernel_paths"]
            raw.setdefault("cpu_variant", backend["variant"])
        raw["kernel_paths"][model] = paths
        for rep in range(cfg.reps):
            order = SERVERS[rep % 3 :] + SERVERS[: rep % 3]
            for k in cfg.levels:
                for key in order:
                    others = [pid for other, pid in pids.items() if other != key]
                    with H.paused(others), H.CpuWatch([pids[key]]) as cpu:
                        run = decode(urls[key], cfg, model, rep, k)
                    H.progress(f"{model} rep {rep} k={k} {key}: {run['decode_tps']:.1f} tok/s")
                    raw["runs"].append({"model": model, "rep": rep, "k": k, "server": key,
                                        "foreign_cpu_cores": cpu.foreign_cores, **run})  # fmt: skip


def measure(cfg: Config, binary: str) -> dict[str, Any]:
    os.environ.pop(PATHS_ENV, None)  # "paths on" is the gate's choice unless cfg.on says

    for var in OMP_VARS:  # each server gets exactly H.SERVER_ENV's
        os.environ.pop(var, None)
    raw: dict[str, Any] = {
        "env": R.environment(),
        "llama_server": U.llama_server_info(binary),
        "kernel_paths": {},
        "runs": [],
    }
    for model in cfg.models:
        measure_model(cfg, binary, model, raw)
    return raw


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in cfg.models:
        per: dict[str, Any] = {}
        for k in cfg.levels:
            cell: dict[tuple[int, str], dict[str, Any]] = {
                (r["rep"], r["server"]): r
                for r in raw["runs"]
                if r["model"] == model and r["k"] == k
            }
            reps = sorted({rep for rep, _ in cell})
            row: dict[str, Any] = {
                key: H.summarize([cell[rep, key]["decode_tps"] for rep in reps]).as_dict()
                for key in SERVERS
            }
            for num, den in (("polykv", "llama_server"), ("polykv_ggml", "llama_server"),
                             ("polykv", "polykv_ggml")):  # fmt: skip
                ratios = [
                    cell[rep, num]["decode_tps"] / cell[rep, den]["decode_tps"] for rep in reps
                ]
                row[f"{num}/{den}"] = H.summarize(ratios).as_dict()
            # Greedy tokens: the two PolyKV columns must agree exactly (the paths are
            # bit-identical); llama-server batches differently and may round differently.
            row["same_tokens_paths"] = sum(
                same_streams(cell[rep, "polykv"], cell[rep, "polykv_ggml"]) for rep in reps
            )
            row["same_tokens_upstream"] = sum(
                same_streams(cell[rep, "polykv"], cell[rep, "llama_server"]) for rep in reps
            )
            row["reps"] = len(reps)
            per[str(k)] = row
        out[model] = per
    return out


def on_text(cfg: Config) -> str:
    if cfg.on is None:
        return "the kernel paths its gate picks for this CPU"
    return (
        f"`{PATHS_ENV}={cfg.on}` (paths chosen for this measurement, not by the gate: a path "
        "is measured this way before the gate turns it on for a CPU family)"
    )


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    parts = [
        "### Kernel paths on and off against llama-server",
        "",
        f"Measured on an {R.machine_name(env)}, {env['cpu_count']} cores. Greedy decode, "
        f"{cfg.n_predict} tokens per stream, k streams released together; "
        f"`{' '.join(common_args(cfg))}` for every server. *llama-server*: "
        f"{raw['llama_server']['version']}, built by `bench/build_llama_server.sh` from the "
        "llama.cpp tree of the engine's wheel without its patches. *PolyKV, paths on*: the "
        f"engine's wheel with {on_text(cfg)} "
        f"(ggml variant {raw.get('cpu_variant', '?')}); *paths off*: the same wheel with "
        f"`{PATHS_ENV}=none` (ggml's own kernels, as in llama-server). Median (min–max) of "
        f"{cfg.reps} repetitions, the servers in rotated order, the others stopped, every "
        f"one with the OpenMP wait policy {env.get('omp_wait_policy', '?')}; ratios "
        "paired per repetition. *Same tokens*: repetitions whose greedy tokens were identical "
        "(compared by text where llama-server streamed no id for a token that ends inside a "
        "UTF-8 character). "
        "The paths are bit-identical to ggml's kernels (tests/engine/real), but a server's "
        "steps group concurrent streams differently from run to run (a stream joining a step "
        "later, prompts beside decodes), and ggml rounds each batch shape its own way: from 4 "
        "streams, no two runs need agree, on or off, PolyKV or llama-server.",
    ]
    for model in cfg.models:
        on = ", ".join(raw["kernel_paths"][model]["polykv"]) or "none"
        rows = []
        for k in cfg.levels:
            row = res[model][str(k)]
            rows.append([
                str(k),
                *(R.fmt(row[key]) for key in SERVERS),
                *(R.fmt(row[r], 2, unit="×") for r in
                  ("polykv/llama_server", "polykv_ggml/llama_server", "polykv/polykv_ggml")),
                f"{row['same_tokens_paths']}/{row['reps']}",
                f"{row['same_tokens_upstream']}/{row['reps']}",
            ])  # fmt: skip
        headers = ["streams", *(f"{LABELS[key]} tok/s" for key in SERVERS), "on ÷ llama-server",
                   "off ÷ llama-server", "on ÷ off", "same tokens on/off",
                   "same tokens vs llama-server"]  # fmt: skip
        parts += ["", f"**{model}** (paths on: {on})", "", R.markdown_table(headers, rows)]
    foreign = [r["foreign_cpu_cores"] for r in raw["runs"]]
    parts += ["", R.provenance(NAME, env, foreign)]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-predict", type=int, default=96)
    p.add_argument("--models", default=",".join(Config.models))
    p.add_argument("--levels", default="1,2,4,8", help="stream counts, comma-separated")
    p.add_argument(
        "--on",
        default=None,
        help=f"{PATHS_ENV} for the 'paths on' server (default: the gate's choice for this CPU)",
    )
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render)) is not None:
        return rc
    cfg = Config(
        reps=args.reps,
        n_predict=args.n_predict,
        models=tuple(args.models.split(",")),
        levels=tuple(int(k) for k in args.levels.split(",")),
        on=args.on,
    )
    if args.quick:
        cfg.reps, cfg.n_predict, cfg.levels = 1, 16, (1, 8)
    if cfg.reps < 1 or not cfg.levels or min(cfg.levels) < 1:
        p.error("--reps and every level must be >= 1")
    if (binary := U.llama_server_or_skip(NAME)) is None:
        return 0
    return R.run_and_publish(NAME, cfg, args, lambda c: measure(c, binary), analyse, render)


if __name__ == "__main__":
    raise SystemExit(main())
