"""Issue 14 benchmark: what polykv-router adds to a request, side by side with direct ones.

One engine (the bench model), one router in front of it (static replica: no Kubernetes in
the path, only the router's own work), one client. Every measurement alternates a direct
request and a routed one (direct first on even pairs, routed first on odd ones), so drift
and other load hit both sides alike:

* ``request``: a continuation turn, not streamed, one token (the prompt is cached, so the
  engine's own time is small): time to the whole response;
* ``first token``: the same, streamed: time to the first SSE event;
* ``new session``: the first request of a session id nobody knows (the router asks every
  replica whether it holds it, then places it), one token, not streamed;
* ``stream``: a continuation streaming ``n_predict`` tokens with EOS suppressed: decode
  tok/s from first to last event, and the time added per token.

Per repeat: the median of each side and the median of the paired differences; the table
shows the median (min–max) over repeats. The router's own view is its
``polykv_router_added_latency_seconds`` histogram (time before it sends upstream).

Targets: < 2 ms added per request at p50; streaming >= 0.98 x direct.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from . import harness as H
from . import report as R

NAME = "router_overhead"
TARGET_ADDED_MS = 2.0
TARGET_STREAM_RATIO = 0.98
PROMPT = (
    "You are the research crew. Cite sources, be brief. Survey shared-prefix KV caching "
    "and report what you find."
)
KINDS = ("request", "first_token", "new_session")


@dataclass
class Config:
    reps: int = 3
    pairs: int = 60
    stream_pairs: int = 3
    n_predict: int = 128
    threads: int = 2


def _post(c: httpx.Client, base: str, session: str, n: int) -> float:
    body = {"prompt": PROMPT, "n_predict": n, "temperature": 0}
    t0 = time.perf_counter()
    r = c.post(base + "/completion", json=body, headers={"x-session-id": session})
    if r.status_code != 200:
        raise H.BenchError(f"{base}: {r.status_code} {r.text[:300]}")
    return (time.perf_counter() - t0) * 1e3


def _stream(c: httpx.Client, base: str, session: str, n: int) -> tuple[float, list[float]]:
    """(ms to the first event, arrival times of every token event)."""
    body = {"prompt": PROMPT, "n_predict": n, "temperature": 0, "stream": True}
    if n > 8:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    arrivals: list[float] = []
    with c.stream("POST", base + "/completion", json=body, headers={"x-session-id": session}) as r:
        if r.status_code != 200:
            r.read()
            raise H.BenchError(f"{base}: {r.status_code} {r.text[:300]}")
        for line in r.iter_lines():
            if line.startswith("data:") and '"stop": false' in line:
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise H.BenchError(f"{base}: no token events")
    return (arrivals[0] - t0) * 1e3, arrivals


def _pairs(fn: Any, direct: str, routed: str, n: int, label: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "router": []}
    for i in range(n):
        order = [("direct", direct), ("router", routed)]
        for side, base in order if i % 2 == 0 else order[::-1]:
            out[side].append(fn(base, side, i))
    H.progress(f"{label}: {n} pairs")
    return out


def measure_rep(cfg: Config, c: httpx.Client, direct: str, routed: str, rep: int) -> dict[str, Any]:
    # Warm both paths: connections, the sessions' slots and prompt caches.
    for base, side in ((direct, "direct"), (routed, "router")):
        for _ in range(3):
            _post(c, base, f"warm-{side}-{rep}", 1)

    def request(base: str, side: str, i: int) -> float:
        return _post(c, base, f"warm-{side}-{rep}", 1)

    def first_token(base: str, side: str, i: int) -> float:
        return _stream(c, base, f"warm-{side}-{rep}", 1)[0]

    def new_session(base: str, side: str, i: int) -> float:
        return _post(c, base, f"new-{side}-{rep}-{i}", 1)

    out: dict[str, Any] = {"rep": rep}
    for kind, fn in (
        ("request", request),
        ("first_token", first_token),
        ("new_session", new_session),
    ):
        out[kind] = _pairs(fn, direct, routed, cfg.pairs, kind)
    streams: dict[str, list[dict[str, float]]] = {"direct": [], "router": []}
    for i in range(cfg.stream_pairs):
        order = [("direct", direct), ("router", routed)]
        for side, base in order if i % 2 == 0 else order[::-1]:
            ttft, arr = _stream(c, base, f"warm-{side}-{rep}", cfg.n_predict)
            span = arr[-1] - arr[0]
            streams[side].append(
                {"tokens": len(arr), "ttft_ms": ttft, "span_s": span, "tps": (len(arr) - 1) / span}
            )
    H.progress(f"stream: {cfg.stream_pairs} pairs of {cfg.n_predict} tokens")
    out["stream"] = streams
    return out


def _histogram_means(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for suffix, into in (("_sum", sums), ("_count", counts)):
            name = f"polykv_router_added_latency_seconds{suffix}"
            if line.startswith(name + "{"):
                kind = line.split('kind="', 1)[1].split('"', 1)[0]
                into[kind] = float(line.rsplit(" ", 1)[1])
    return {k: sums[k] / counts[k] * 1e3 for k in sums if counts.get(k)}


def measure(cfg: Config) -> dict[str, Any]:
    model = H.bench_model()
    env = R.environment()
    env["cpu_busy_cores_before"] = round(H.wait_for_quiet(max_busy_cores=0.5, max_wait_s=20), 2)
    args = ["-np", "4", "-c", "4096", "-t", str(cfg.threads), "-fa", "off"]
    runs = []
    with H.engine("router_overhead-engine", model, args) as eng:
        router = H.ServerProcess(
            "router_overhead-router",
            [sys.executable, "-m", "polykv_router.cli", "--port", "{port}", "--host",
             "127.0.0.1", "--replica", f"e={eng.host}:{eng.port}"],
            ready_path="/readyz",
        )  # fmt: skip
        with H.server(router), H.http_client() as c:
            with H.CpuWatch([eng.proc.pid if eng.proc else 0, router.pid]) as cpu:
                for rep in range(cfg.reps):
                    H.progress(f"repeat {rep + 1}/{cfg.reps}")
                    runs.append(measure_rep(cfg, c, eng.base_url, router.base_url, rep))
            router_view = _histogram_means(c.get(router.base_url + "/metrics").text)
    env["foreign_cores"] = round(cpu.foreign_cores, 2)
    return {
        "env": env,
        "model": {"path": str(model), "bytes": model.stat().st_size},
        "router_added_ms_mean": router_view,
        "runs": runs,
    }


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        d, r, added = [], [], []
        for run in raw["runs"]:
            side = run[kind]
            d.append(statistics.median(side["direct"]))
            r.append(statistics.median(side["router"]))
            added.append(
                statistics.median(
                    b - a for a, b in zip(side["direct"], side["router"], strict=True)
                )
            )
        out[kind] = {
            "direct_ms": H.summarize(d).as_dict(),
            "router_ms": H.summarize(r).as_dict(),
            "added_ms": H.summarize(added).as_dict(),
        }
    ratio, per_token, ttft_added = [], [], []
    for run in raw["runs"]:
        s = run["stream"]
        ratio.append(
            statistics.median(
                b["tps"] / a["tps"] for a, b in zip(s["direct"], s["router"], strict=True)
            )
        )
        per_token.append(
            statistics.median(
                (b["span_s"] / (b["tokens"] - 1) - a["span_s"] / (a["tokens"] - 1)) * 1e3
                for a, b in zip(s["direct"], s["router"], strict=True)
            )
        )
        ttft_added.append(
            statistics.median(
                b["ttft_ms"] - a["ttft_ms"] for a, b in zip(s["direct"], s["router"], strict=True)
            )
        )
    out["stream"] = {
        "direct_tps": H.summarize(
            [statistics.median(x["tps"] for x in run["stream"]["direct"]) for run in raw["runs"]]
        ).as_dict(),
        "router_tps": H.summarize(
            [statistics.median(x["tps"] for x in run["stream"]["router"]) for run in raw["runs"]]
        ).as_dict(),
        "ratio": H.summarize(ratio).as_dict(),
        "added_ms_per_token": H.summarize(per_token).as_dict(),
        "ttft_added_ms": H.summarize(ttft_added).as_dict(),
    }
    worst_added = max(out[k]["added_ms"]["median"] for k in ("request", "first_token"))
    out["targets"] = {
        "added_ms_p50": {"value": worst_added, "met": worst_added < TARGET_ADDED_MS},
        "stream_ratio": {
            "value": out["stream"]["ratio"]["median"],
            "met": out["stream"]["ratio"]["median"] >= TARGET_STREAM_RATIO,
        },
    }
    return out


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    names = {
        "request": "continuation, whole response (1 token)",
        "first_token": "continuation, first streamed token",
        "new_session": "new session id (lookup on every replica + placement)",
    }
    rows = [
        [
            names[k],
            R.fmt(res[k]["direct_ms"], 2),
            R.fmt(res[k]["router_ms"], 2),
            R.fmt(res[k]["added_ms"], 2),
        ]
        for k in KINDS
    ]
    s = res["stream"]
    view = raw.get("router_added_ms_mean", {})
    t = res["targets"]
    lines = [
        "### Router overhead: polykv-router vs direct requests",
        "",
        f"Bench model `{Path(raw['model']['path']).name}`, one engine (`-np 4 -c 4096 "
        f"-t {cfg.threads} -fa off`) and one router in front of it (a static replica), "
        f"one client over keep-alive connections. Each measurement alternates a direct and a "
        f"routed request ({cfg.pairs} pairs per repeat; {cfg.stream_pairs} pairs of "
        f"{cfg.n_predict}-token streams); per repeat the median of each side and of the "
        f"paired differences, then median (min–max) of {cfg.reps} repeats.",
        "",
        R.markdown_table(["request", "direct (ms)", "through the router (ms)", "added (ms)"], rows),
        "",
        R.markdown_table(
            [
                "stream",
                "direct tok/s",
                "router tok/s",
                "router ÷ direct",
                "added per token (ms)",
                "first token added (ms)",
            ],
            [
                [
                    f"{cfg.n_predict} tokens",
                    R.fmt(s["direct_tps"], 1),
                    R.fmt(s["router_tps"], 1),
                    R.fmt(s["ratio"], 3, unit="×"),
                    R.fmt(s["added_ms_per_token"], 3),
                    R.fmt(s["ttft_added_ms"], 2),
                ]
            ],
        ),
        "",
        "The router's own count of its time before it sends a request upstream (mean of "
        "`polykv_router_added_latency_seconds`): "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(view.items()))
        + ".",
        "",
        R.markdown_table(
            ["target", "measured", "verdict"],
            [
                [
                    "< 2 ms added per request at p50",
                    f"{t['added_ms_p50']['value']:.2f} ms (worst of the two continuation rows)",
                    "**met**" if t["added_ms_p50"]["met"] else "**missed**",
                ],
                [
                    "streaming ≥ 0.98 × direct",
                    f"{t['stream_ratio']['value']:.3f}×",
                    "**met**" if t["stream_ratio"]["met"] else "**missed**",
                ],
            ],
        ),
        "",
        R.provenance(
            NAME,
            env,
            note=f"Other processes used {env.get('foreign_cores', 0):.2f} cores on average "
            "while measuring.",
        ),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router_overhead", description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=60, help="direct/routed pairs per measurement")
    p.add_argument("--stream-pairs", type=int, default=3)
    p.add_argument("--n-predict", type=int, default=128, help="tokens per measured stream")
    p.add_argument("--threads", type=int, default=2)
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render)) is not None:
        return rc
    cfg = Config(args.reps, args.pairs, args.stream_pairs, args.n_predict, args.threads)
    if args.quick:
        cfg.reps, cfg.pairs, cfg.stream_pairs, cfg.n_predict = 1, 10, 1, 32
    if cfg.reps < 1 or cfg.pairs < 2 or cfg.stream_pairs < 1 or cfg.n_predict < 16:
        p.error("need --reps >= 1, --pairs >= 2, --stream-pairs >= 1, --n-predict >= 16")
    return R.run_and_publish(NAME, cfg, args, measure, analyse, render)


if __name__ == "__main__":
    raise SystemExit(main())
