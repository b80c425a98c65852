"""PolyKV against upstream llama-server on plain decode: aggregate tokens/s at 1/2/4/8
streams, on the bench model and a real quantized instruction model, side by side in one run.

llama-server is built from the llama.cpp tree vendored in the pinned llama-cpp-python sdist
(``bench/build_llama_server.sh``), with the same portable CPU build, so both servers run the
same kernels. The engine runs twice, once per OpenMP wait policy (passive: idle compute
threads sleep at every barrier; active: they spin), to decide the default by measurement.
Every repetition visits the servers in a rotated order, and the tokens each server produced
for the same greedy prompt are compared.

Workload per level k: k distinct prompts released at one instant, each streaming
``n_predict`` greedy tokens with EOS ignored. Aggregate decode tok/s = tokens after each
stream's first / the union of the streams' [first, last] token spans (prefill excluded).
HTTP responsiveness: while 8 streams decode, a probe asks for one token every 0.3 s on a
ninth slot; its time to first token (p50, p99) shows whether spinning threads starve the
server's own event loop.

    python -m bench.vs_llama_server [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import harness as H

NAME = "vs_llama_server"
LEVELS = (1, 2, 4, 8)
N_SLOTS = 9  # 8 streams + the responsiveness probe
CTX = 9 * 1024
_WORDS = (  # noqa: SIM905
    "the river city morning light garden window story old friend quiet market winter "
    "train letter music road table house evening summer child teacher paper bridge"
).split()


@dataclass
class Config:
    reps: int = 3
    n_predict: int = 128
    threads: int = 2
    models: tuple[str, ...] = ("bench", "smollm2-135m-instruct-q4_1")
    levels: tuple[int, ...] = LEVELS
    probe_interval_s: float = 0.3


@dataclass
class Server:
    key: str
    label: str
    base_url: str
    proc: Any = field(repr=False, default=None)


def prompt(model: str, rep: int, k: int, i: int) -> str:
    rng = random.Random(f"{model}/{rep}/{k}/{i}")
    return f"Note {i}: " + " ".join(rng.choice(_WORDS) for _ in range(24)) + "."


def model_path(name: str) -> Path:
    if name == "bench":
        return H.bench_model()
    from tests.conftest import real_model_path

    return real_model_path(name)


@contextlib.contextmanager
def servers(model: Path, cfg: Config) -> Iterator[list[Server]]:
    common = ["-np", str(N_SLOTS), "-c", str(CTX), "-t", str(cfg.threads), "-fa", "off"]
    binary = subprocess.run(
        [str(H.REPO_ROOT / "bench" / "build_llama_server.sh")],
        check=True, capture_output=True, text=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    with contextlib.ExitStack() as stack:
        out = []
        ls = H.ServerProcess(
            "llama-server",
            [
                binary,
                "-m",
                str(model),
                *common,
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--no-webui",
            ],
            "/health",
            env={"LD_LIBRARY_PATH": str(Path(binary).parent)},  # its own OpenMP default
        )
        stack.enter_context(H.server(ls))
        out.append(Server("llama_server", "llama-server", ls.base_url))
        for policy in ("passive", "active"):
            eng = stack.enter_context(
                H.engine(
                    f"polykv-{policy}", model, [*common, "--metrics"], {"OMP_WAIT_POLICY": policy}
                )
            )
            out.append(Server(f"polykv_{policy}", f"PolyKV ({policy} threads)", eng.base_url))
        yield out


def stream(
    client: httpx.Client, base: str, text: str, n: int
) -> tuple[float, float, float, list[int]]:
    """(t_send, t_first, t_last, tokens) of one streamed greedy completion."""
    body = {"prompt": text, "n_predict": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_prompt": False}  # fmt: skip
    t_send = time.perf_counter()
    t_first = t_last = 0.0
    tokens: list[int] = []
    for now, ev in H.sse_events(client, f"{base}/completion", body):
        toks = ev.get("tokens") or []
        if toks:
            t_first = t_first or now
            t_last = now
            tokens += toks
    if len(tokens) != n:
        raise H.BenchError(f"{base}: {len(tokens)} tokens streamed, {n} asked")
    return t_send, t_first, t_last, tokens


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

        def released() -> None:
            if k == max(cfg.levels):
                prober.start()
                started[0] = True

        runs = H.run_together(fns, released)
        stop.set()
        if started[0]:
            prober.join(30)
    spans = [(first, last) for _, first, last, _ in runs]
    decoded = sum(len(toks) - 1 for *_, toks in runs)
    return {
        "decode_tps": decoded / H.merged_length(spans),
        "first_token_s": max(first - send for send, first, _, _ in runs),
        "tokens": runs[0][3],
        "probe_ttft_s": probes,
    }


def measure(cfg: Config) -> dict[str, Any]:
    raw: dict[str, Any] = {"env": H.environment(), "runs": []}
    for model in cfg.models:
        path = model_path(model)
        H.progress(f"{model}: starting llama-server and two engines")
        with servers(path, cfg) as srvs:
            for rep in range(cfg.reps):
                order = srvs[rep % len(srvs) :] + srvs[: rep % len(srvs)]
                for k in cfg.levels:
                    for srv in order:
                        H.progress(f"{model} rep {rep + 1}/{cfg.reps} k={k} {srv.label}")
                        r = one_level(srv, cfg, model, rep, k)
                        raw["runs"].append({"model": model, "rep": rep, "k": k,
                                            "server": srv.key, **r})  # fmt: skip
    return raw


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    runs = raw["runs"]
    out: dict[str, Any] = {}
    for model in cfg.models:
        rows: dict[str, Any] = {}
        for k in cfg.levels:

            def of(key: str, field_: str, k: int = k, model: str = model) -> list[Any]:
                return [
                    r[field_]
                    for r in runs
                    if r["model"] == model and r["k"] == k and r["server"] == key
                ]

            row: dict[str, Any] = {}
            ls = of("llama_server", "decode_tps")
            for key in ("llama_server", "polykv_passive", "polykv_active"):
                row[key] = H.summarize(of(key, "decode_tps")).as_dict()
            for key in ("polykv_passive", "polykv_active"):
                paired = [a / b for a, b in zip(of(key, "decode_tps"), ls, strict=True)]
                row[f"{key}_ratio"] = H.summarize(paired).as_dict()
            if k == max(cfg.levels):
                for key in ("llama_server", "polykv_passive", "polykv_active"):
                    probes = [p for ps in of(key, "probe_ttft_s") for p in ps]
                    if probes:
                        row[f"{key}_probe"] = {
                            "p50": statistics.median(probes),
                            "p99": sorted(probes)[min(len(probes) - 1, int(0.99 * len(probes)))],
                            "n": len(probes),
                        }
            toks = {key: of(key, "tokens") for key in ("llama_server", "polykv_passive")}
            row["identical_tokens"] = sum(
                a == b for a, b in zip(toks["llama_server"], toks["polykv_passive"], strict=True)
            )
            row["compared"] = len(toks["llama_server"])
            rows[str(k)] = row
        out[model] = rows
    return out


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    env = raw["env"]
    parts = [
        "### Plain decode against upstream llama-server",
        "",
        f"{cfg.n_predict} greedy tokens per stream, EOS ignored, k distinct prompts released "
        f"together; `-np {N_SLOTS} -c {CTX} -t {cfg.threads} -fa off` for every server; "
        "llama-server built from the llama.cpp tree the engine runs on "
        "(`bench/build_llama_server.sh`, same portable CPU build). Aggregate decode tok/s, "
        f"median (min–max) of {cfg.reps} repetitions in rotated server order; ratios are "
        "paired per repetition. *Probe*: one-token requests on a ninth slot every "
        f"{cfg.probe_interval_s} s while 8 streams decode, time to first token.",
        "",
    ]
    for model, rows in res.items():
        parts.append(f"**{model}**")
        parts.append("")
        table = []
        for k, row in rows.items():
            table.append([
                k,
                H.Summary(tuple(row["llama_server"]["values"])).fmt(0),
                H.Summary(tuple(row["polykv_passive"]["values"])).fmt(0),
                H.Summary(tuple(row["polykv_active"]["values"])).fmt(0),
                H.Summary(tuple(row["polykv_passive_ratio"]["values"])).fmt(2, unit="×"),
                H.Summary(tuple(row["polykv_active_ratio"]["values"])).fmt(2, unit="×"),
                f"{row['identical_tokens']}/{row['compared']}",
            ])  # fmt: skip
        parts.append(H.markdown_table(
            ["streams", "llama-server tok/s", "PolyKV passive tok/s", "PolyKV active tok/s",
             "passive ÷ llama-server", "active ÷ llama-server", "same tokens"],
            table,
        ))  # fmt: skip
        top = rows[str(max(cfg.levels))]
        labels = {"llama_server": "llama-server", "polykv_passive": "PolyKV passive",
                  "polykv_active": "PolyKV active"}  # fmt: skip
        probe = [
            f"{label}: p50 {top[f'{key}_probe']['p50'] * 1e3:.0f} ms, "
            f"p99 {top[f'{key}_probe']['p99'] * 1e3:.0f} ms ({top[f'{key}_probe']['n']} probes)"
            for key, label in labels.items()
            if f"{key}_probe" in top
        ]
        if probe:
            parts += ["", "Probe during 8 streams — " + "; ".join(probe) + "."]
        parts.append("")
    parts.append(
        f"{env['cpu']}, {env['cpu_count']} cores; load average at start "
        f"{env['loadavg_at_start'][0]:.2f}. Commit {env['git_commit']}, {env['date_utc']}; "
        f"`python -m bench.{NAME}`, raw numbers in `bench/results/{NAME}.json`."
    )
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-predict", type=int, default=128)
    p.add_argument("--models", default="bench,smollm2-135m-instruct-q4_1")
    H.add_output_flags(p)
    args = p.parse_args(argv)
    cfg = Config(reps=args.reps, n_predict=args.n_predict, models=tuple(args.models.split(",")))
    if args.quick:
        cfg = Config(reps=1, n_predict=16, models=cfg.models, levels=(1, 8))
    return H.run_and_publish(NAME, cfg, args, measure, analyse, render)


if __name__ == "__main__":
    raise SystemExit(main())
