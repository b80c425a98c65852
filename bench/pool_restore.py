"""Pools after a restart: prefilled again against restored from KV snapshots, side by side in
one run; and a new replica's pools fetched from a peer against prefilled.

Each repetition and case (a model, pools of N tokens, one or several):

* **prefill**: an engine starts on an empty snapshot directory and creates the pools (each
  one prefilled, then saved);
* **restore**: the engine restarts on that directory and creates the same pools (each one
  read, checked and loaded from its snapshot);
* **peer**: a second engine, on an empty directory of its own, creates them with the first
  one named as ``restore_peer`` (the file streamed over loopback HTTP, checked, loaded):
  what a scale-up replica does.

Timed per pool from the create request to its answer (the pool resident), and per engine
from the process's start to every pool Ready (model load included). The engines run with
the defaults (f16 KV, flash attention), one slot, ``-t 2``.

    python -m bench.pool_restore [--reps 2] [--quick] [--case MODEL:TOKENS:POOLS ...]
    python -m bench.pool_restore --from-json bench/results/pool_restore.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import harness as H
from . import report as R
from .engine_client import Api
from .upstream import model_path
from .workload import filler_tokens

NAME = "pool_restore"
MODES = ("prefill", "restore", "peer")
ADMIN = "bench-admin"


@dataclass
class Config:
    reps: int = 2
    # (model, pool lengths in tokens, how many pools of that length)
    cases: tuple[tuple[str, int, int], ...] = (
        ("smollm2-135m-instruct-q4_1", 2000, 1),
        ("smollm2-135m-instruct-q4_1", 8000, 1),
        ("smollm2-135m-instruct-q4_1", 2000, 4),
        ("gemma-3-270m-q4_k_m", 2000, 1),
        ("gemma-3-270m-q4_k_m", 8000, 1),
        ("gemma-3-270m-q4_k_m", 24000, 1),
    )
    threads: int = 2


def pool_tokens(api: Api, n_tokens: int, i: int) -> list[int]:
    """A distinct prefix of exactly ``n_tokens`` for pool ``i``."""
    return filler_tokens(api, f"Team brief {i}: ", f"pool_restore/{i}", n_tokens)


@contextlib.contextmanager
def booted(
    label: str, model: Path, ctx: int, store: Path, threads: int
) -> Iterator[tuple[Api, float]]:
    """An engine on ``store``: its API once healthy, and when its process was spawned."""
    args = ["-np", "1", "-c", str(ctx), "-t", str(threads), "--polykv-admin-key", ADMIN,
            "--polykv-snapshot-dir", str(store), "--polykv-snapshot-mib", "8192"]  # fmt: skip
    with H.http_client() as client:
        client.headers["Authorization"] = f"Bearer {ADMIN}"
        t0 = time.perf_counter()
        with H.engine(label, model, args) as eng:
            assert eng.proc is not None
            yield Api(client, eng.base_url, eng.proc.pid), t0


def create_all(
    api: Api, started: float, prefixes: Sequence[list[int]], peer: str | None
) -> dict[str, Any]:
    """Create every pool in turn; per pool (seconds, source, snapshot bytes), and the time
    from the engine's spawn to the last pool resident."""
    pools = []
    for i, tokens in enumerate(prefixes):
        body: dict[str, Any] = {"name": f"pool-{i}", "tokens": tokens}
        if peer is not None:
            body["restore_peer"] = peer
        t0 = time.perf_counter()
        out = api.post("/polykv/pools", body)
        seconds = time.perf_counter() - t0
        restore = out["restore"]
        pools.append(
            {"seconds": seconds, "source": restore["source"], "bytes": restore["snapshot_bytes"]}
        )
    return {"pools": pools, "boot_to_ready_s": time.perf_counter() - started}


def wait_written(api: Api, n: int) -> int:
    """Until the store holds ``n`` snapshots; its bytes."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        snaps = api.pools()["snapshots"]
        if snaps["files"] >= n:
            return int(snaps["used_bytes"])
        time.sleep(0.2)
    raise H.BenchError("the snapshots were not written within 10 minutes")


def one_case(cfg: Config, model_name: str, n_tokens: int, n_pools: int, rep: int) -> dict[str, Any]:
    model = model_path(model_name)
    ctx = n_tokens * n_pools + 512
    out: dict[str, Any] = {"model": model_name, "tokens": n_tokens, "pools": n_pools, "rep": rep}
    with tempfile.TemporaryDirectory(prefix="polykv-bench-") as tmp:
        store, fresh = Path(tmp) / "store", Path(tmp) / "fresh"
        with booted("pool-restore-prefill", model, ctx, store, cfg.threads) as (api, t0):
            prefixes = [pool_tokens(api, n_tokens, rep * 10 + i) for i in range(n_pools)]
            out["prefill"] = create_all(api, t0, prefixes, None)
            out["store_bytes"] = wait_written(api, n_pools)
        with booted("pool-restore-restore", model, ctx, store, cfg.threads) as (api, t0):
            out["restore"] = create_all(api, t0, prefixes, None)
            with booted("pool-restore-peer", model, ctx, fresh, cfg.threads) as (new, t1):
                out["peer"] = create_all(new, t1, prefixes, api.base_url)
    for mode in MODES:
        got = {p["source"] for p in out[mode]["pools"]}
        want = {"prefill": "prefill", "restore": "store", "peer": "peer"}[mode]
        if got != {want}:
            raise H.BenchError(f"{model_name} {n_tokens}: {mode} pools came from {got}")
    H.progress(
        f"rep {rep + 1} {model_name} {n_pools}×{n_tokens}: "
        + ", ".join(f"{m} {sum(p['seconds'] for p in out[m]['pools']):.2f} s" for m in MODES)
    )
    return out


def measure(cfg: Config) -> dict[str, Any]:
    raw: dict[str, Any] = {"env": R.environment(), "runs": []}
    for rep in range(cfg.reps):
        for model_name, n_tokens, n_pools in cfg.cases:
            raw["runs"].append(one_case(cfg, model_name, n_tokens, n_pools, rep))
    # Other work on the machine slows every mode alike within a case; the ratios hold.
    raw["loadavg_at_end"] = list(os.getloadavg())
    return raw


def _key(model: str, tokens: int, pools: int) -> str:
    return f"{model}/{tokens}/{pools}"


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, tokens, pools in cfg.cases:
        runs = [
            r
            for r in raw["runs"]
            if (r["model"], r["tokens"], r["pools"]) == (model, tokens, pools)
        ]
        if not runs:
            continue

        def pooled(r: dict[str, Any], mode: str) -> float:
            return float(sum(p["seconds"] for p in r[mode]["pools"]))

        row: dict[str, Any] = {
            "store_mib": H.summarize([r["store_bytes"] / 2**20 for r in runs]).as_dict()
        }
        for mode in MODES:
            row[mode] = H.summarize([pooled(r, mode) for r in runs]).as_dict()
            row[f"{mode}_boot"] = H.summarize([r[mode]["boot_to_ready_s"] for r in runs]).as_dict()
        for mode in ("restore", "peer"):
            row[f"{mode}_ratio"] = H.summarize(
                [pooled(r, "prefill") / pooled(r, mode) for r in runs]
            ).as_dict()
            row[f"{mode}_boot_ratio"] = H.summarize(
                [r["prefill"]["boot_to_ready_s"] / r[mode]["boot_to_ready_s"] for r in runs]
            ).as_dict()
        out[_key(model, tokens, pools)] = row
    return out


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    end_load = raw.get("loadavg_at_end", [float("nan")])[0]
    lines = [
        "### Pools after a restart: prefill against restore from snapshots, and from a peer",
        "",
        "An engine creates its pools on an empty snapshot directory (*prefill*: computed, then "
        "saved), restarts on that directory and creates them again (*restore*: read, checked, "
        "loaded), and a second engine on an empty directory creates them from the first as "
        "its `restore_peer` (*peer*: streamed over loopback HTTP, checked, kept, loaded), as a "
        "scale-up replica does. *Pools*: from the create requests to the pools resident. "
        "*Boot → Ready*: from the engine process's start (model load included) to the last "
        f"pool resident. Median (min–max) of {cfg.reps} repetitions; `-np 1 -t {cfg.threads}`, "
        "f16 KV, flash attention (the engine's defaults).",
        "",
    ]
    headers = [
        "model, pools × tokens", "snapshot", "pools: prefill", "restore", "peer",
        "prefill ÷ restore", "prefill ÷ peer", "boot → Ready: prefill", "restore", "÷",
    ]  # fmt: skip
    rows = []
    for model, tokens, pools in cfg.cases:
        row = res.get(_key(model, tokens, pools))
        if row is None:
            continue
        rows.append(
            [
                f"{model}, {pools} × {tokens}",
                R.fmt(row["store_mib"], 0, 1, " MiB"),
                R.fmt(row["prefill"], 1, 1, " s"),
                R.fmt(row["restore"], 2, 1, " s"),
                R.fmt(row["peer"], 2, 1, " s"),
                R.fmt(row["restore_ratio"], 0, 1, "×"),
                R.fmt(row["peer_ratio"], 0, 1, "×"),
                R.fmt(row["prefill_boot"], 1, 1, " s"),
                R.fmt(row["restore_boot"], 1, 1, " s"),
                R.fmt(row["restore_boot_ratio"], 1, 1, "×"),
            ]
        )
    lines.append(R.markdown_table(headers, rows))
    lines += [
        "",
        R.provenance(NAME, env, note=f"Load average at the end: {end_load:.2f}."),
    ]
    return "\n".join(lines)


def _case(text: str) -> tuple[str, int, int]:
    model, tokens, pools = text.rsplit(":", 2)
    return model, int(tokens), int(pools)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=Config.reps)
    p.add_argument("--threads", type=int, default=Config.threads)
    p.add_argument(
        "--case",
        action="append",
        type=_case,
        help="MODEL:TOKENS:POOLS, repeatable (default: every case of Config)",
    )
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render)) is not None:
        return rc
    cfg = Config(reps=args.reps, threads=args.threads)
    if args.case:
        cfg.cases = tuple(args.case)
    if args.quick:
        cfg = Config(reps=1, cases=(("smollm2-135m-instruct-q4_1", 500, 1),), threads=args.threads)
    return R.run_and_publish(NAME, cfg, args, measure, analyse, render)


if __name__ == "__main__":
    raise SystemExit(main())
