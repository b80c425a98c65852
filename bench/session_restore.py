"""A session's next turn after a rollout: its cache restored against its prompt prefilled,
side by side in one run.

Each repetition and case (a model, a session of N tokens):

* an engine on an empty snapshot directory runs the session's first turn (N prompt tokens,
  8 generated), then gets SIGTERM: after the drain it writes the session's cache (*save*:
  from the signal to the process's exit, the model freed too);
* a new engine on that directory runs the session's next turn, the first turn's tokens and
  a short question, one token generated (*restored*: the file read and checked, its cells
  loaded, the question prefilled), and the same prompt as a cold request (*prefill*: every
  token computed). Both from the request to its answer; whether they answer the same token
  is recorded (a cold prefill sums in other batch shapes: a near-tie can differ).

The engines run with the defaults (f16 KV, flash attention), one slot, ``-t 2``.

    python -m bench.session_restore [--reps 2] [--quick] [--case MODEL:TOKENS ...]
    python -m bench.session_restore --from-json bench/results/session_restore.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import harness as H
from . import report as R
from .engine_client import Api
from .upstream import model_path
from .workload import filler_tokens

NAME = "session_restore"
SESSION = "agent-1"


@dataclass
class Config:
    reps: int = 2
    cases: tuple[tuple[str, int], ...] = (  # (model, the session's first prompt in tokens)
        ("smollm2-135m-instruct-q4_1", 2000),
        ("smollm2-135m-instruct-q4_1", 8000),
        ("gemma-3-270m-q4_k_m", 2000),
    )
    threads: int = 2


def engine_args(ctx: int, store: Path, threads: int) -> list[str]:
    return ["-np", "1", "-c", str(ctx), "-t", str(threads), "--polykv-snapshot-dir", str(store),
            "--polykv-snapshot-mib", "8192"]  # fmt: skip


def ask(
    api: Api, prompt: list[int], n_predict: int, session: str | None
) -> tuple[dict[str, Any], float]:
    body: dict[str, Any] = {"prompt": prompt, "n_predict": n_predict, "temperature": 0}
    if session is None:
        body["cache_prompt"] = False
    else:
        body["session_id"] = session
    t0 = time.perf_counter()
    out = api.post("/completion", body)
    return dict(out), time.perf_counter() - t0


def one_case(cfg: Config, model_name: str, n_tokens: int, rep: int) -> dict[str, Any]:
    model = model_path(model_name)
    out: dict[str, Any] = {"model": model_name, "tokens": n_tokens, "rep": rep}
    with tempfile.TemporaryDirectory(prefix="polykv-bench-") as tmp, H.http_client() as client:
        store = Path(tmp) / "store"
        args = engine_args(n_tokens + 512, store, cfg.threads)
        with H.engine("session-restore-first", model, args) as eng:
            assert eng.proc is not None
            api = Api(client, eng.base_url, eng.proc.pid)
            prompt = filler_tokens(api, f"Agent log {rep}: ", f"session_restore/{rep}", n_tokens)
            first, _ = ask(api, prompt, 8, SESSION)
            nxt = prompt + first["tokens"] + api.tokenize(" What next?", add_special=False)
            t0 = time.perf_counter()
            if eng.stop(timeout=600) != 0:
                raise H.BenchError("the engine did not exit cleanly on SIGTERM")
            out["save_s"] = time.perf_counter() - t0
        files = list(store.glob("*.pkvs"))
        if len(files) != 1:
            raise H.BenchError(f"{len(files)} session files written, expected 1")
        out["file_bytes"] = files[0].stat().st_size
        with H.engine("session-restore-next", model, args) as eng:
            assert eng.proc is not None
            api = Api(client, eng.base_url, eng.proc.pid)
            ask(api, nxt[:8], 1, None)  # a first decode's one-off costs, paid by neither
            restored, out["restored_s"] = ask(api, nxt, 1, SESSION)
            # The turn after, in the now warm process: what a turn costs with its cache in
            # place all along (the restored one also pays this process's first long decode).
            _, out["warm_s"] = ask(api, nxt + restored["tokens"] + nxt[-3:], 1, SESSION)
            cold, out["prefill_s"] = ask(api, nxt, 1, None)
    out["cache_n"] = restored["timings"]["cache_n"]
    # The engine's own part: from the turn holding its slot to its first token.
    out["restored_prompt_ms"] = restored["timings"]["prompt_ms"]
    out["prefill_prompt_ms"] = cold["timings"]["prompt_ms"]
    if out["cache_n"] < n_tokens:
        raise H.BenchError(f"the restored turn reused {out['cache_n']} of {n_tokens} tokens")
    # A cold prefill computes the same tokens in other batch shapes, and quantized matmuls
    # and flash attention sum in an order that follows the shape: a near-tie can pick
    # another token. The restored cells are the old process's own (the exact-equality tests
    # run F32 weights, f32 KV and -fa off).
    out["same_token"] = restored["tokens"] == cold["tokens"]
    H.progress(
        f"rep {rep + 1} {model_name} {n_tokens}: save {out['save_s']:.2f} s, next turn "
        f"restored {out['restored_s']:.2f} s, prefilled {out['prefill_s']:.2f} s"
    )
    return out


def measure(cfg: Config) -> dict[str, Any]:
    raw: dict[str, Any] = {"env": R.environment(), "runs": []}
    for rep in range(cfg.reps):
        for model_name, n_tokens in cfg.cases:
            raw["runs"].append(one_case(cfg, model_name, n_tokens, rep))
    raw["loadavg_at_end"] = list(os.getloadavg())
    return raw


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, tokens in cfg.cases:
        runs = [r for r in raw["runs"] if (r["model"], r["tokens"]) == (model, tokens)]
        if not runs:
            continue
        row: dict[str, Any] = {
            k: H.summarize([r[k] for r in runs]).as_dict()
            for k in ("save_s", "restored_s", "warm_s", "prefill_s", "cache_n")
        }
        row["file_mib"] = H.summarize([r["file_bytes"] / 2**20 for r in runs]).as_dict()
        row["ratio"] = H.summarize([r["prefill_s"] / r["restored_s"] for r in runs]).as_dict()
        row["same_token"] = f"{sum(r['same_token'] for r in runs)} of {len(runs)}"
        out[f"{model}/{tokens}"] = row
    return out


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    end_load = raw.get("loadavg_at_end", [float("nan")])[0]
    lines = [
        "### A session's next turn after a rollout: its cache restored against prefilled",
        "",
        "An engine runs a session's first turn and gets SIGTERM (*save*: from the signal to "
        "the process's exit, the session's cache written after the drain). A new engine on "
        "the same snapshot directory runs the session's next turn (*restored*: the file read "
        "and checked, its cells loaded into the session's slot, the new question prefilled) "
        "and the same prompt cold (*prefill*), one token each, from the request to the "
        "answer; *warm*: the session's turn after that, its cache in place, as in a process "
        "that never restarted (the restored turn also pays the new process's first decode "
        "over a long context). *Same token*: runs whose two answers agree. The restored cells"
        " are the old process's own, so its answer is the one the old process would have "
        "given; a cold prefill computes the prompt in other batch shapes, and quantized "
        "matmuls and flash attention sum in an order that follows the shape, so a near-tie "
        "can differ (on F32 weights with f32 KV and `-fa off` they agree: "
        f"`tests/engine/http/test_session_snapshots.py`). Median (min–max) of {cfg.reps} "
        f"repetitions; `-np 1 -t {cfg.threads}`, f16 KV, flash attention (the engine's "
        "defaults).",
        "",
    ]
    headers = ["model, session tokens", "file", "save", "next turn: prefill", "restored", "÷",
               "warm", "tokens reused", "same token"]  # fmt: skip
    rows = []
    for model, tokens in cfg.cases:
        row = res.get(f"{model}/{tokens}")
        if row is None:
            continue
        rows.append(
            [
                f"{model}, {tokens}",
                R.fmt(row["file_mib"], 0, 1, " MiB"),
                R.fmt(row["save_s"], 2, 1, " s"),
                R.fmt(row["prefill_s"], 1, 1, " s"),
                R.fmt(row["restored_s"], 2, 1, " s"),
                R.fmt(row["ratio"], 0, 1, "×"),
                R.fmt(row.get("warm_s"), 2, 1, " s"),
                R.fmt(row["cache_n"]),
                row["same_token"],
            ]
        )
    lines.append(R.markdown_table(headers, rows))
    lines += ["", R.provenance(NAME, raw["env"], note=f"Load average at the end: {end_load:.2f}.")]
    return "\n".join(lines)


def _case(text: str) -> tuple[str, int]:
    model, tokens = text.rsplit(":", 1)
    return model, int(tokens)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--threads", type=int, default=Config.threads)
    p.add_argument(
        "--case", action="append", type=_case, help="MODEL:TOKENS, repeatable (default: all)"
    )
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render)) is not None:
        return rc
    cfg = Config(reps=args.reps, threads=args.threads)
    if args.case:
        cfg.cases = tuple(args.case)
    if args.quick:
        cfg = Config(reps=1, cases=(("smollm2-135m-instruct-q4_1", 500),), threads=args.threads)
    return R.run_and_publish(NAME, cfg, args, measure, analyse, render)


if __name__ == "__main__":
    raise SystemExit(main())
