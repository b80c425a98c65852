"""Speculative decoding from the context: decode rate with and without it, PolyKV against
upstream llama-server's own speculative modes, on agent-like turns and on plain prose.

Workloads (one chat turn each, rendered once through the engine's chat template and sent as
the same tokens to every server):

* *tool call* — an agent's transcript: it listed one team's files and read each of them, one
  JSON call per record, then listed another team's; its next turn reads those, echoing each
  record's id, path and row count from the tool result as its own earlier calls did;
* *code edit* — a file, then a request to rename a function and output the whole file: the
  answer repeats most of the file;
* *quoting summary* — a report, then a request to summarise it quoting its key sentences;
* *prose* — a story to write: nothing to copy.

Servers: PolyKV (``speculative.type`` per request: ``none`` or ``ngram``, one engine) and
upstream llama-server, built from the same llama.cpp tree without PolyKV's kernel patches
(``bench/build_llama_server.sh``), once per ``--spec-type`` (``none`` and each n-gram mode it
offers; no draft model). One stream at a time, greedy, ``n_predict`` tokens; the decode rate
is measured by the client, token by token: (tokens after the first) / (last − first). Every
repetition starts every server afresh (llama-server's ngram-mod and ngram-cache remember
earlier requests) and visits the configurations in a rotated order, the servers not measured
stopped with SIGSTOP; every server runs the harness's OpenMP wait policy. Per server the
text with speculation is compared with the text without.

    python -m bench.speculative [--reps 3] [--quick]
    python -m bench.speculative --from-json bench/results/speculative.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from . import harness as H
from . import report as R
from .engine_client import Api
from .upstream import llama_server_env, llama_server_or_skip, model_path

NAME = "speculative"
LS_MODES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
AGENT_WORKLOADS = ("tool_call", "code_edit", "quote")
WORKLOADS = (*AGENT_WORKLOADS, "prose")
LABELS = {
    "tool_call": "tool call",
    "code_edit": "code edit",
    "quote": "quoting summary",
    "prose": "prose",
}

_RECORDS = [
    {
        "id": 1000 + i,
        "path": f"/srv/data/shard-{i:02d}/part-{i * 7 % 13:02d}.parquet",
        "owner": f"team-{'abcdefgh'[i % 8]}",
        "rows": 12000 + 37 * i,
    }
    for i in range(64)
]


def _listing(team: str) -> str:
    """What the list_files tool returns for a team: its records, one JSON object a line."""
    return "\n".join(json.dumps(r) for r in _RECORDS if r["owner"] == team)


def _reads(team: str) -> str:
    """The agent's read_file calls for a team's records, one JSON object a line."""
    return "\n".join(
        json.dumps({"tool": "read_file", "id": r["id"], "path": r["path"], "rows": r["rows"]})
        for r in _RECORDS
        if r["owner"] == team
    )


_CODE = "\n".join(
    [
        "import math",
        "",
        "",
        "def compute_total(items, tax_rate=0.2):",
        '    """Sum the prices of the items and add the tax."""',
        "    subtotal = 0.0",
        "    for item in items:",
        "        subtotal += item.price * item.quantity",
        "    return round(subtotal * (1.0 + tax_rate), 2)",
        "",
        "",
        "def average_price(items):",
        "    if not items:",
        "        return 0.0",
        "    return compute_total(items, tax_rate=0.0) / len(items)",
        "",
        "",
        "class Basket:",
        "    def __init__(self):",
        "        self.items = []",
        "",
        "    def add(self, item):",
        "        self.items.append(item)",
        "",
        "    def total(self):",
        "        return compute_total(self.items)",
        "",
        "    def mean(self):",
        "        return average_price(self.items)",
    ]
)
_REPORT = (
    "The migration of the storage cluster finished on Tuesday at 14:20. All 24 shards were "
    "copied to the new nodes and verified by checksum. Two shards, 07 and 19, needed a second "
    "copy because the first attempt timed out. Read latency dropped from 41 ms to 12 ms at the "
    "95th percentile. The old nodes will be kept read-only for two weeks and then wiped. The "
    "team recommends moving the backup schedule from nightly to every six hours."
)
CHATS: dict[str, list[dict[str, str]]] = {
    # An agent's transcript as the model sees it on its next turn (tool calls and results in
    # plain turns: SmolLM2's template has no tool roles).
    "tool_call": [
        {
            "role": "system",
            "content": "You are an agent. You call tools by answering with JSON objects, "
            "one per line.",
        },
        {"role": "user", "content": "Load the data files of team-a, then those of team-c."},
        {"role": "assistant", "content": '{"tool": "list_files", "owner": "team-a"}'},
        {"role": "user", "content": "The tool list_files returned:\n" + _listing("team-a")},
        {"role": "assistant", "content": _reads("team-a")},
        {"role": "user", "content": "The tool read_file returned 8 files."},
        {"role": "assistant", "content": '{"tool": "list_files", "owner": "team-c"}'},
        {"role": "user", "content": "The tool list_files returned:\n" + _listing("team-c")},
    ],
    "code_edit": [
        {"role": "system", "content": "You are a careful programmer."},
        {
            "role": "user",
            "content": "Here is a Python file:\n\n```python\n"
            + _CODE
            + "\n```\n\nRename the function compute_total to total_price everywhere and output "
            "the whole updated file in one code block, changing nothing else.",
        },
    ],
    "quote": [
        {"role": "system", "content": "You write short, exact summaries."},
        {
            "role": "user",
            "content": "Report:\n\n"
            + _REPORT
            + "\n\nSummarise the report for the team lead. Quote each of its sentences "
            "verbatim in a bulleted list, then add one line of your own.",
        },
    ],
    "prose": [
        {"role": "system", "content": "You are a storyteller."},
        {
            "role": "user",
            "content": "Write a short story about a lighthouse keeper who finds a message in "
            "a bottle. Make every sentence new.",
        },
    ],
}


@dataclass
class Config:
    reps: int = 3
    model: str = "smollm2-135m-instruct-q4_1"
    n_predict: int = 256
    threads: int = 2
    flash_attn: str = "on"
    ls_modes: tuple[str, ...] = LS_MODES
    swa_full: bool = False  # a sliding-window model: a rejected guess must be droppable


@dataclass
class Target:
    key: str  # polykv_none, polykv_ngram, ls_<mode>
    base_url: str
    pid: int
    spec: str | None  # PolyKV's speculative.type; None for llama-server


def label(key: str) -> str:
    if key.startswith("polykv_"):
        return f"PolyKV {key.removeprefix('polykv_')}"
    return f"llama-server {key.removeprefix('ls_')}"


def stream_rate(client: httpx.Client, tgt: Target, tokens: list[int], n: int) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": tokens, "n_predict": n, "temperature": 0.0,
                            "stream": True, "cache_prompt": False}  # fmt: skip
    if tgt.spec is not None:
        body["speculative.type"] = tgt.spec
    times: list[float] = []
    out: list[int] = []
    final: dict[str, Any] = {}
    for now, ev in H.sse_events(client, f"{tgt.base_url}/completion", body):
        toks = ev.get("tokens") or []
        times += [now] * len(toks)
        out += toks
        if ev.get("stop"):
            final = ev
    if len(out) < 8:
        raise H.BenchError(f"{tgt.key}: only {len(out)} tokens")
    span = times[-1] - times[0]
    timings = final.get("timings") or {}
    return {
        "tps": (len(out) - 1) / span if span > 0 else 0.0,
        "n": len(out),
        "tokens": out,
        "draft_n": timings.get("draft_n"),
        "draft_n_accepted": timings.get("draft_n_accepted"),
    }


@contextlib.contextmanager
def targets(cfg: Config, binary: str, model: Path) -> Iterator[tuple[list[Target], Api]]:
    common = ["-np", "1", "-c", "4096", "-t", str(cfg.threads), "-fa", cfg.flash_attn]
    if cfg.swa_full:  # both servers: a window that recycles cells cannot take a guess back
        common.append("--swa-full")
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(H.http_client())
        eng = stack.enter_context(
            H.engine("polykv-spec", model, [*common, "--polykv-stream-interval-ms", "0"])
        )
        assert eng.proc is not None
        out = [
            Target("polykv_none", eng.base_url, eng.proc.pid, "none"),
            Target("polykv_ngram", eng.base_url, eng.proc.pid, "ngram"),
        ]
        for mode in cfg.ls_modes:
            argv = [binary, "-m", str(model), *common, "--spec-type", mode,
                    "--host", "127.0.0.1", "--port", "{port}", "--no-webui"]  # fmt: skip
            env = llama_server_env(binary)
            ls = H.ServerProcess(f"llama-server-spec-{mode}", argv, "/health", env=env)
            stack.enter_context(H.server(ls))
            out.append(Target(f"ls_{mode}", ls.base_url, ls.pid, None))
        yield out, Api(client, eng.base_url, eng.proc.pid)


def prompts(api: Api) -> dict[str, list[int]]:
    out = {}
    for name, messages in CHATS.items():
        text = api.post("/apply-template", {"messages": messages})["prompt"]
        out[name] = api.tokenize(text, add_special=False)
    return out


def measure(cfg: Config, binary: str) -> dict[str, Any]:
    raw: dict[str, Any] = {"env": R.environment(), "runs": []}
    for rep in range(cfg.reps):
        # Fresh servers every repetition: llama-server's ngram-mod and ngram-cache keep what
        # they saw across requests, so a repeated request would draft from its own earlier
        # answer (ngram-mod read 3x on the second of three identical runs), which measures
        # the benchmark's repetition, not the workload.
        with targets(cfg, binary, model_path(cfg.model)) as (tgts, api):
            toks = prompts(api)
            raw["prompt_tokens"] = {k: len(v) for k, v in toks.items()}
            pids = {t.pid for t in tgts}
            order = tgts[rep % len(tgts) :] + tgts[: rep % len(tgts)]
            for wl in WORKLOADS:
                for tgt in order:
                    with H.paused([p for p in pids if p != tgt.pid]), H.CpuWatch([tgt.pid]) as cpu:
                        run = stream_rate(api.client, tgt, toks[wl], cfg.n_predict)
                    H.progress(
                        f"rep {rep + 1}/{cfg.reps} {LABELS[wl]:<15} {label(tgt.key):<26} "
                        f"{run['tps']:6.1f} tok/s, {run['n']} tokens"
                        + (
                            f", kept {run['draft_n_accepted']}/{run['draft_n']}"
                            if run["draft_n"]
                            else ""
                        )
                    )
                    raw["runs"].append({"rep": rep, "workload": wl, "server": tgt.key,
                                        "foreign_cpu_cores": cpu.foreign_cores, **run})  # fmt: skip
                    time.sleep(0.2)
    return raw


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    runs = raw["runs"]
    keys = ["polykv_none", "polykv_ngram", *(f"ls_{m}" for m in cfg.ls_modes)]
    out: dict[str, Any] = {}
    for wl in WORKLOADS:

        def of(key: str, wl: str = wl) -> dict[int, dict[str, Any]]:
            return {r["rep"]: r for r in runs if r["workload"] == wl and r["server"] == key}

        row: dict[str, Any] = {}
        for key in keys:
            rs = of(key)
            if not rs:
                continue
            base = of("polykv_none" if key.startswith("polykv") else "ls_none")
            cell: dict[str, Any] = {"tps": H.summarize([r["tps"] for r in rs.values()]).as_dict()}
            pairs = [(rs[i], base[i]) for i in rs if i in base]
            if pairs and key not in ("polykv_none", "ls_none"):
                cell["speedup"] = H.summarize([a["tps"] / b["tps"] for a, b in pairs]).as_dict()
                cell["same_text"] = sum(a["tokens"] == b["tokens"] for a, b in pairs)
                cell["compared"] = len(pairs)
            drafted = sum(r["draft_n"] or 0 for r in rs.values())
            if drafted:
                cell["acceptance"] = sum(r["draft_n_accepted"] or 0 for r in rs.values()) / drafted
            row[key] = cell
        ls_best = max(
            (k for k in row if k.startswith("ls_")),
            key=lambda k: row[k]["tps"]["median"],
            default=None,
        )
        if ls_best is not None and "polykv_ngram" in row:
            ng, best = of("polykv_ngram"), of(ls_best)
            row["vs_ls_best"] = {
                "mode": ls_best,
                "ratio": H.summarize(
                    [ng[i]["tps"] / best[i]["tps"] for i in ng if i in best]
                ).as_dict(),
            }
        out[wl] = row
    return out


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    lines = [
        f"### Speculative decoding from the context ({cfg.model}, one stream)",
        "",
        "Decode rate (tok/s, measured by the client token by token) without and with "
        "speculation, and the speed-up paired per repetition; llama-server: upstream, built "
        "from the same llama.cpp tree without PolyKV's kernel patches, each `--spec-type` a "
        "server of its own (no draft model). *Same text*: repetitions whose tokens equal the "
        f"run without speculation. Median (min–max) of {cfg.reps} repetitions, fresh servers "
        f"each, configurations alternating; greedy, {cfg.n_predict} tokens, `-np 1 -c 4096 "
        f"-t {cfg.threads} -fa {cfg.flash_attn}{' --swa-full' if cfg.swa_full else ''}` for "
        f"every server.",
        "",
    ]
    headers = ["workload", "PolyKV none", "PolyKV ngram", "speed-up", "kept", "same text",
               "llama-server none", "its best mode", "its speed-up", "ngram ÷ best"]  # fmt: skip
    rows = []
    for wl in WORKLOADS:
        row = res.get(wl) or {}
        ng = row.get("polykv_ngram") or {}
        best = (row.get("vs_ls_best") or {}).get("mode")
        bc = row.get(best) or {} if best else {}
        rows.append(
            [
                LABELS[wl],
                R.fmt((row.get("polykv_none") or {}).get("tps"), 1),
                R.fmt(ng.get("tps"), 1),
                R.fmt(ng.get("speedup"), 2, 1, "×"),
                f"{100 * ng['acceptance']:.0f}%" if ng.get("acceptance") is not None else "–",
                f"{ng.get('same_text', 0)}/{ng.get('compared', 0)}",
                R.fmt((row.get("ls_none") or {}).get("tps"), 1),
                f"{best.removeprefix('ls_')}: {R.fmt(bc.get('tps'), 1)}" if best else "–",
                R.fmt(bc.get("speedup"), 2, 1, "×"),
                R.fmt((row.get("vs_ls_best") or {}).get("ratio"), 2, 1, "×"),
            ]
        )
    lines.append(R.markdown_table(headers, rows))
    foreign = [r["foreign_cpu_cores"] for r in raw["runs"]]
    lines += [
        "",
        R.provenance(
            result_name(cfg.model),
            env,
            foreign,
            note=f"Prompt tokens: {raw.get('prompt_tokens')}.",
            command=R.command_line(
                NAME, cfg.model, Config.model, "--swa-full" if cfg.swa_full else ""
            ),
        ),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default=Config.model)
    p.add_argument("--n-predict", type=int, default=Config.n_predict)
    p.add_argument("--ls-modes", default=",".join(LS_MODES), help="llama-server --spec-type's")
    p.add_argument(
        "--swa-full",
        action="store_true",
        help="both servers keep a sliding-window model's whole cache (Gemma 3: else no guess)",
    )
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (
        rc := R.from_json(lambda c: result_name(c.model), args, Config, analyse, render)
    ) is not None:
        return rc
    modes = tuple(m for m in args.ls_modes.split(",") if m)
    cfg = Config(
        reps=args.reps,
        model=args.model,
        n_predict=args.n_predict,
        ls_modes=modes,
        swa_full=args.swa_full,
    )
    if args.quick:
        cfg.reps, cfg.n_predict = 1, 96
    if cfg.reps < 1 or cfg.n_predict < 16 or "none" not in cfg.ls_modes:
        p.error("--reps >= 1, --n-predict >= 16, --ls-modes must include none")
    if (binary := llama_server_or_skip(NAME)) is None:
        return 0
    name = result_name(cfg.model)
    return R.run_and_publish(name, cfg, args, lambda c: measure(c, binary), analyse, render)


def result_name(model: str) -> str:
    """Where a run on ``model`` is published (the default model's under the bench's name)."""
    return R.result_name(NAME, model, Config.model)


if __name__ == "__main__":
    raise SystemExit(main())
