"""What a unified KV cache costs decoding sessions that share nothing, and where it comes
from: llama-server with split streams, llama-server with one unified cache, and PolyKV (a
unified cache by design), side by side in one run.

8 sessions, each with its own prompt of ``context_tokens`` (no token in common), decode
greedy answers at once. In split streams a session's attention reads its own cells only. In
one unified cache its cells lie among every other session's: ggml's CPU flash-attention
kernel visits every cell of the cache and masks the others' out, so its work per token grows
with the sum of all sessions' contexts, not with its own. PolyKV's build carries a kernel
patch (``ggml-cpu-fa-live-cells``) that skips words of fully masked cells; upstream's
unified column runs without it, so the two unified columns separate the kernel from the
layout. Decode rates are counted over the span in which all 8 sessions decode.

    python -m bench.unified_attention [--reps 2] [--context-tokens 2000] [--quick]
    python -m bench.unified_attention --from-json bench/results/unified_attention.json
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import harness as H
from . import report as R
from . import upstream as U
from .engine_client import Api
from .long_prefix import AGENTS, SUFFIX_ROOM, Target, timed_round, warm_up
from .workload import make_workload

NAME = "unified_attention"
SERVERS = ("llama_server", "llama_server_unified", "polykv")
LABELS = {
    "llama_server": "llama-server, split streams",
    "llama_server_unified": "llama-server, `--kv-unified`",
    "polykv": "PolyKV (unified)",
}


@dataclass
class Config:
    reps: int = 2
    model: str = "smollm2-135m-instruct-q4_1"
    context_tokens: int = 2000  # each session's own prompt
    decode_tokens: int = 48
    threads: int = 2
    flash_attn: str = "on"

    def ctx(self) -> int:
        return AGENTS * (self.context_tokens + SUFFIX_ROOM)


def common_args(cfg: Config) -> list[str]:
    return ["-np", str(AGENTS), "-c", str(cfg.ctx()), "-t", str(cfg.threads),
            "-fa", cfg.flash_attn]  # fmt: skip


def measure(cfg: Config, binary: str) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "env": R.environment(),
        "llama_server": U.llama_server_info(binary),
        "polykv_patches": _patches(),
        "runs": [],
    }
    model = U.model_path(cfg.model)
    args = [*common_args(cfg), "--polykv-park-mib", "0", "--polykv-stream-interval-ms", "0"]
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(H.http_client(timeout_s=3600))
        eng = stack.enter_context(H.engine("polykv-unified", model, args))
        assert eng.proc is not None
        api = Api(client, eng.base_url, eng.proc.pid)
        warm_up(client, api.base_url)
        tgts = {"polykv": Target("polykv", api.base_url, api.pid)}
        for key, extra in (("llama_server", []), ("llama_server_unified", ["--kv-unified"])):
            argv = [binary, "-m", str(model), *common_args(cfg), *extra, "--host", "127.0.0.1",
                    "--port", "{port}", "--no-webui"]  # fmt: skip
            ls = H.ServerProcess(key, argv, "/health", env=U.llama_server_env(binary))
            stack.enter_context(H.server(ls))
            warm_up(client, ls.base_url)
            # Both llama-server variants take the llama-server request shape (id_slot).
            tgts[key] = Target("llama_server", ls.base_url, ls.pid)
        wl = make_workload(api, 16, AGENTS * cfg.context_tokens * cfg.reps)
        pids = {t.pid for t in tgts.values()}
        for rep in range(cfg.reps):
            prompts = [wl.take(cfg.context_tokens) for _ in range(AGENTS)]
            order = SERVERS[rep % len(SERVERS) :] + SERVERS[: rep % len(SERVERS)]
            for key in order:
                if key == "polykv":
                    api.reset(AGENTS)
                with H.paused([p for p in pids if p != tgts[key].pid]):
                    run = timed_round(client, tgts[key], prompts, cfg.decode_tokens, None)
                if key == "polykv":
                    run["kv_cells"] = int(api.pools()["kv_cells_used"])
                raw["runs"].append({"rep": rep, "server": key, **run})
                d = run["decode"] or {}
                H.progress(
                    f"rep {rep + 1} {LABELS[key]:<30} decode all 8 "
                    f"{d.get('aggregate', 0):6.1f} tok/s, first token "
                    f"{run['ttft_median_s']:6.1f} s, other load {run['foreign_cores']:.2f} cores"
                )
    return raw


def _patches() -> list[str]:
    from polykv_engine.llama.runtime import build_patches

    return list(build_patches())


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    by_rep: dict[int, dict[str, float]] = {}
    for r in raw["runs"]:
        if r["decode"] is not None:
            by_rep.setdefault(r["rep"], {})[r["server"]] = r["decode"]["aggregate"]
    for key in SERVERS:
        runs = [r for r in raw["runs"] if r["server"] == key]
        decode = [r["decode"] for r in runs if r["decode"] is not None]
        ratios = [v[key] / v["llama_server"] for v in by_rep.values() if key in v and
                  "llama_server" in v]  # fmt: skip
        out[key] = {
            "decode_aggregate": _summ([d["aggregate"] for d in decode]),
            "decode_per_session": _summ([d["per_session_median"] for d in decode]),
            "vs_split": _summ(ratios),
            "ttft_s": _summ([r["ttft_median_s"] for r in runs]),
            "foreign_cores": _summ([r["foreign_cores"] for r in runs]),
        }
    return out


def _summ(values: Sequence[float]) -> dict[str, Any] | None:
    return H.summarize(values).as_dict() if values else None


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env, ls = raw["env"], raw["llama_server"]
    head = ["server", "decode tok/s, all 8", "per session", "÷ split streams",
            "first token (prefill of 8 prompts), s", "other load, cores"]  # fmt: skip
    rows = [
        [LABELS[key], R.fmt(r["decode_aggregate"], 1), R.fmt(r["decode_per_session"], 2),
         R.fmt(r["vs_split"], 2, 1, "×"), R.fmt(r["ttft_s"], 1), R.fmt(r["foreign_cores"], 2)]
        for key, r in res.items()
    ]  # fmt: skip
    patches = ", ".join(raw.get("polykv_patches") or ()) or "none"
    return "\n".join(
        [
            f"### A unified cache and sessions that share nothing ({cfg.model}, "
            f"{AGENTS} × {cfg.context_tokens} tokens)",
            "",
            R.markdown_table(head, rows),
            "",
            f"{AGENTS} sessions, each its own {cfg.context_tokens}-token prompt, decode "
            f"{cfg.decode_tokens} greedy tokens at once; decode rates over the span in which "
            f"all decode. All servers: `-np {AGENTS} -c {cfg.ctx()} -t {cfg.threads} -fa "
            f"{cfg.flash_attn}`. llama-server {ls['version']}, built by "
            "`bench/build_llama_server.sh` from the llama.cpp tree of the engine's wheel "
            f"without its patches, in both llama-server columns; PolyKV on llama-cpp-python "
            f"{env['llama_cpp_python']} with patches: {patches}. *÷ split streams*: paired per "
            f"repetition. Median (min–max) of {cfg.reps} repetitions, the servers in rotated "
            "order, the ones not measured stopped (SIGSTOP).",
            "",
            R.provenance(NAME, env),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--model", default=Config.model)
    p.add_argument("--context-tokens", type=int, default=Config.context_tokens)
    p.add_argument("--decode-tokens", type=int, default=Config.decode_tokens)
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render)) is not None:
        return rc
    cfg = Config(args.reps, args.model, args.context_tokens, args.decode_tokens)
    if args.quick:
        cfg.reps, cfg.context_tokens, cfg.decode_tokens = 1, 300, 16
    if cfg.reps < 1 or cfg.context_tokens < 64 or cfg.decode_tokens < 8:
        p.error("--reps >= 1, --context-tokens >= 64, --decode-tokens >= 8")
    if (binary := U.llama_server_or_skip(NAME)) is None:
        return 0
    return R.run_and_publish(NAME, cfg, args, lambda c: measure(c, binary), analyse, render)


if __name__ == "__main__":
    raise SystemExit(main())
