"""A spawn ramp against a tps floor: naive gates vs the engine's floor admission.

Policy names: ``p7`` is the floor admission the engine ships (the name comes from the
seventh change of the engine's specification, which introduced it); ``p7-*`` are variants.

An orchestrator ticks every few seconds and
may start one more agent per tick; agents attach to one pool and loop: decode a turn of
``TURN_TOKENS`` tokens, pause like a tool call, send the next turn (same session, the tool's
answer appended). An agent's context is a rolling window (the shared prefix, its task, its
last turn and the tool's answer), so the cost of a token stays stationary over the run and a
floor calibrated at the start stays valid to its end. Agents never retire during a run (the
spec's workers retire only at episode end), so an over-admit stays until the run ends.

1. **Calibration** (``CAL_PASSES`` passes): agents are added one at a time, 10 s apart, with
   no gate; at each count n = 1..6 the median ``mean_active_tps`` over every pass's readings
   taken while all n decode at once gives this CPU's curve (made monotone).
   The floor goes where the curve drops most between 3 and 5 agents (midway across that
   drop), so the engine saturates around there; ``n_ok`` = the agent count it supports.
2. **Runs**, each on a fresh fork of the shared pool (so no admission state carries over),
   policies alternating in order between repeats:

   * ``naive-raw``: the orchestrator reads ``GET /polykv/tps`` and spawns when the raw
     ``mean_active_tps`` is at or above the floor, or when nothing is measured (every agent
     between turns): an orchestrator's own scheduler; no settling, no server-side gate;
   * ``naive-proj``: the same, with the raw mean projected by the flat-aggregate model,
     mean x n/(n+1) over the n sessions with a measurement;
   * ``p7``: ``POST /polykv/pools/{pool}/admission`` {floor, enforced, reject, guarantee 1,
     settle_tokens, settle_max_ms}; the orchestrator spawns only when ``GET
     /polykv/pools/{pool}/capacity`` says ``can_admit`` and no session is warming (spec
     §14.3), never while its last spawn is still unanswered, and after a 429 waits the
     ``Retry-After`` it was given. The engine's projection is pause-aware (agents in a tool
     call count as load) and scaled by its measured step-time curve;
   * ``p7-live``: the same on an engine started with ``--no-polykv-pause-aware-admission``
     (the projection sees only the sessions decoding at that moment);
   * ``p7-paced``: ``p7-live`` plus pacing: after a spawn the orchestrator waits until every
     agent has finished a turn with the new one present, so the next reading includes it;
   * ``p7-step-cap``: ``p7`` on an engine started with ``--polykv-admission-ceiling step``
     (the projection capped by decode-only step times, not by token-to-token times).

Measured by sampling ``GET /polykv/tps`` every 0.2 s: time under the floor (seconds in which
``mean_active_tps`` < floor while at least one session has a measurement), the deepest dip,
peak concurrent agents, overshoot (peak - ``n_ok``), plus spawns, 429s, holds, and the
engine's aggregate decode rate (``polykv_tokens_decoded_total``) as the price paid.

Target: time under the floor with ``p7`` at least 50% lower than with the naive gate.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import harness as H
from . import report as R
from .engine_client import Api
from .workload import Workload, make_workload

NAME = "spawn_ramp"
N_PARALLEL = 8
CTX = 16384
PREFIX_TOKENS = 2000
TASK_MIN, TASK_MAX = 50, 100
TURN_TOKENS = 96
TOOL_TOKENS = 24
PAUSE_S = (0.3, 1.0)
TICK_S = 3.0
SAMPLE_S = 0.2
RUN_S = 40.0
CAL_MAX = 6
CAL_HOLD_S = 10.0
CAL_SKIP_S = 3.0  # of each calibration level, the part left out while it settles
CAL_PASSES = 3
SAT_RANGE = (3, 5)
TARGET_REDUCTION = 0.5
SETTLE_TOKENS = 48  # the spec's defaults
SETTLE_MAX_MS = 5000
POLICIES = ("naive-raw", "naive-proj", "p7-live", "p7-paced", "p7-step-cap", "p7")
# Policies run against an engine of their own, started with these flags: one whose admission
# sees only the sessions decoding now (the two ways to fix its over-admits, side by side), and
# one whose projection is capped by decode-only step times (the cap before the cycle curve).
# ``p7`` (as shipped) gets an engine of its own too: the engine-wide step times it learns would
# otherwise carry the naive gates' heavier mixes into its runs, and the A/B with
# p7-step-cap would not be like for like.
ENGINE_FLAGS: dict[str, tuple[str, ...]] = {
    "p7-live": ("--no-polykv-pause-aware-admission",),
    "p7-paced": ("--no-polykv-pause-aware-admission",),
    "p7-step-cap": ("--polykv-admission-ceiling", "step"),
    "p7": ("--polykv-admission-ceiling", "cycle"),
}


# ---------------------------------------------------------------------------- agents


@dataclass
class Agent:
    """One agent's loop, run on its own thread."""

    api: Api
    idx: int
    session_id: str
    pool: str
    prefix: list[int]
    task: list[int]
    filler: Sequence[int]
    stop: threading.Event
    t_spawn: float = 0.0
    state: str = "starting"  # starting -> running | rejected | failed
    t_admitted: float = 0.0
    retry_after_s: float = 0.0
    reject_reason: str = ""
    error: str = ""
    turns: int = 0
    tokens: int = 0
    decode_s: float = 0.0
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.t_spawn = time.monotonic()
        self.thread = threading.Thread(target=self._run, name=f"agent-{self.session_id}")
        self.thread.start()

    def _tool_answer(self) -> list[int]:
        rng = random.Random(f"{self.session_id}/{self.turns}")
        at = rng.randrange(0, len(self.filler) - TOOL_TOKENS)
        return list(self.filler[at : at + TOOL_TOKENS])

    def _run(self) -> None:
        rng = random.Random(self.session_id)
        tail: list[int] = []
        try:
            while not self.stop.is_set():
                generated = self._turn(self.prefix + self.task + tail)
                if generated is None:
                    return
                self.turns += 1
                tail = generated + self._tool_answer()
                self.stop.wait(rng.uniform(*PAUSE_S))
        except Exception as exc:  # reported by the run; one agent must not hang the others
            self.state = "failed"
            self.error = f"{type(exc).__name__}: {exc}"

    def _turn(self, prompt: list[int]) -> list[int] | None:
        body = {
            "prompt": prompt,
            "n_predict": TURN_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "cache_prompt": True,
            "pool_id": self.pool,
            "session_id": self.session_id,
        }
        out: list[int] = []
        t_first = t_last = 0.0
        with self.api.client.stream("POST", self.api.url("/completion"), json=body) as resp:
            if resp.status_code == 429:
                resp.read()
                self.retry_after_s = float(resp.headers.get("Retry-After", "1"))
                with contextlib.suppress(ValueError, KeyError):
                    self.reject_reason = str(json.loads(resp.text)["error"]["reason"])
                self.state = "rejected"
                return None
            if resp.status_code != 200:
                resp.read()
                raise H.BenchError(f"turn -> {resp.status_code}: {resp.text[:300]}")
            if self.state == "starting":
                self.state = "running"
                self.t_admitted = time.monotonic()
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = json.loads(line[5:])
                toks = payload.get("tokens") or []
                if toks:
                    t_last = time.monotonic()
                    t_first = t_first or t_last
                    out.extend(int(t) for t in toks)
                if self.stop.is_set():
                    break  # closing the stream cancels the request on the engine
        if len(out) > 1:
            self.tokens += len(out) - 1
            self.decode_s += t_last - t_first
        return out

    def join(self, timeout: float = 30.0) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    @property
    def live(self) -> bool:
        return self.state in ("starting", "running")


# ---------------------------------------------------------------------------- sampling


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    mean: float
    n_active: int
    n_measured: int
    n_warming: int
    aggregate: float
    n_agents: int


class Sampler:
    """Polls ``GET /polykv/tps`` on its own thread."""

    def __init__(self, api: Api, agents: list[Agent]) -> None:
        self.api = api
        self.agents = agents
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tps-sampler")

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                snap = self.api.get("/polykv/tps")
                measured = sum(
                    1
                    for s in snap["sessions"]
                    if s["state"] == "decoding" and not s["warming"] and s["tps_ewma"] > 0
                )
                self.samples.append(
                    Sample(
                        t=time.monotonic(),
                        mean=float(snap["mean_active_tps"]),
                        n_active=int(snap["n_active"]),
                        n_measured=measured,
                        n_warming=int(snap["n_warming"]),
                        aggregate=float(snap["aggregate_tps"]),
                        n_agents=sum(1 for a in self.agents if a.state == "running"),
                    )
                )
            self._stop.wait(max(0.0, SAMPLE_S - (time.monotonic() - t0)))


def under_floor(samples: Sequence[Sample], floor: float, t0: float, t1: float) -> dict[str, Any]:
    """Time-under-floor metrics over [t0, t1] (each sample holds until the next)."""
    under = measured = 0.0
    dips: list[float] = []
    weighted = 0.0
    for a, b in itertools.pairwise(samples):
        if a.t < t0 or a.t >= t1:
            continue
        dt = min(b.t, t1) - a.t
        if a.n_measured == 0 or a.mean <= 0:
            continue  # nothing decoding with a measurement: no tps to be under
        measured += dt
        weighted += a.mean * dt
        dips.append(a.mean)
        if a.mean < floor:
            under += dt
    return {
        "under_s": under,
        "measured_s": measured,
        "under_share": under / measured if measured else 0.0,
        "deepest_dip": min(dips) if dips else None,
        "time_mean_tps": weighted / measured if measured else None,
    }


# ---------------------------------------------------------------------------- runs


@dataclass
class Run:
    api: Api
    pool: str
    prefix: list[int]  # the pool's tokens: every agent's prompt starts with them
    stream: list[int]  # filler tokens: tasks and tool answers are cut from it
    tag: str
    agents: list[Agent] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def spawn(self) -> Agent:
        idx = len(self.agents)
        rng = random.Random(f"{self.tag}/{idx}")
        n = rng.randint(TASK_MIN, TASK_MAX)
        at = rng.randrange(0, len(self.stream) - n)
        agent = Agent(
            api=self.api,
            idx=idx,
            session_id=f"{self.tag}-{idx}",
            pool=self.pool,
            prefix=self.prefix,
            task=self.stream[at : at + n],
            filler=self.stream,
            stop=self.stop,
        )
        self.agents.append(agent)
        agent.start()
        return agent

    @property
    def live(self) -> list[Agent]:
        return [a for a in self.agents if a.live]

    def finish(self) -> None:
        self.stop.set()
        for a in self.agents:
            a.join()
        failed = [a for a in self.agents if a.state == "failed"]
        if failed:
            raise H.BenchError(f"agent {failed[0].session_id} failed: {failed[0].error}")


TRUNK = "ramp-trunk"


def fresh_run(api: Api, wl: Workload, tag: str) -> Run:
    """A fork of the shared trunk with a short distinct tail: a new pool, no admission state."""
    prefix = wl.prefix + wl.take(16)
    name = f"ramp-{tag}"
    api.fork_pool(TRUNK, name, prefix, len(wl.prefix))
    return Run(api, name, prefix, wl.stream, tag)


def counter(samples: dict[str, float], name: str, pool: str | None = None) -> float:
    total = 0.0
    for key, value in samples.items():
        if not key.startswith(name):
            continue
        if pool is not None and f'pool="{pool}"' not in key:
            continue
        total += value
    return total


def calibration_pass(api: Api, wl: Workload, k: int) -> list[dict[str, Any]]:
    """One pass: agents added one at a time, no gate; per count, every 0.2 s reading taken
    while all of them decoded at once, and the time-mean with tool-call pauses."""
    run = fresh_run(api, wl, f"calibration-{k}")
    levels: list[dict[str, Any]] = []
    with Sampler(api, run.agents) as sampler:
        for n in range(1, CAL_MAX + 1):
            run.spawn()
            t_level = time.monotonic()
            time.sleep(CAL_HOLD_S)
            t_end = time.monotonic()
            stats = under_floor(sampler.samples, 0.0, t_level + CAL_SKIP_S, t_end)
            # The rate while all n decode at once (nobody in a tool call): what a floor must
            # hold for the agents not to dip under it every time their turns line up.
            together = [
                s.mean
                for s in sampler.samples
                if t_level + CAL_SKIP_S <= s.t <= t_end and s.n_measured == n
            ]
            levels.append({"n": n, "mean_tps": stats["time_mean_tps"], "together": together})
            median = statistics.median(together) if together else None
            H.progress(
                f"  calibration pass {k + 1}/{CAL_PASSES}: {n} agent(s), mean_active_tps "
                f"{stats['time_mean_tps']}, all decoding {median}"
            )
    run.finish()
    api.reset(N_PARALLEL, keep=(TRUNK,))
    return levels


def curve_rates(api: Api, family: str) -> dict[str, float]:
    """One of the engine's step-time curves as rates, {b: 1 / t(b)}, beside the readings:
    ``polykv_decode_step_seconds`` (decode-only steps) or ``polykv_decode_cycle_seconds``
    (token to token, any step: admission's cap)."""
    _, samples = H.scrape_metrics(api.client, api.base_url)
    out: dict[str, float] = {}
    for key, seconds in samples.items():
        if key.startswith(f'{family}{{batch="') and seconds > 0:
            out[key.split('"')[1]] = 1.0 / seconds
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def calibrate(api: Api, wl: Workload) -> dict[str, Any]:
    passes: list[list[dict[str, Any]]] = []
    with H.CpuWatch([api.pid]) as cpu:
        for k in range(CAL_PASSES):
            passes.append(calibration_pass(api, wl, k))
    # The floor must hold while every agent decodes at once (their turns line up often): a
    # time-mean, flattered by the moments some are in a tool call, would place it where even
    # a perfect gate spends half its time under it. Each count's rate is the median of its
    # readings over every pass: one pass's 10 s at a count can land on a lucky or an unlucky
    # stretch (one came out 5 agents faster than 4).
    levels: list[dict[str, Any]] = []
    for n in range(1, CAL_MAX + 1):
        at_n = [p[n - 1] for p in passes]
        together = [x for lv in at_n for x in lv["together"]]
        time_means = [lv["mean_tps"] for lv in at_n if lv["mean_tps"]]
        per_pass = [statistics.median(lv["together"]) if lv["together"] else None for lv in at_n]
        levels.append(
            {
                "n": n,
                "all_decoding_tps": statistics.median(together) if together else None,
                "mean_tps": statistics.median(time_means) if time_means else None,
                "per_pass_all_decoding_tps": per_pass,
                "readings": len(together),
            }
        )
    means = [lv["all_decoding_tps"] or lv["mean_tps"] for lv in levels]
    if any(m is None for m in means):
        raise H.BenchError(f"calibration: a level had no measurement: {levels}")
    curve = [float(m) for m in means]
    # Monotone envelope (a later level cannot really be faster), then the sharpest drop
    # between SAT_RANGE agents: the floor sits midway across it.
    env = [min(curve[: i + 1]) for i in range(len(curve))]
    lo, hi = SAT_RANGE
    n_ok = max(range(lo, hi + 1), key=lambda n: env[n - 1] / env[n] if env[n] > 0 else 0.0)
    floor = (env[n_ok - 1] * env[n_ok]) ** 0.5
    return {
        "passes": CAL_PASSES,
        "levels": levels,
        "step_ceiling_tps": curve_rates(api, "polykv_decode_step_seconds"),
        "cycle_ceiling_tps": curve_rates(api, "polykv_decode_cycle_seconds"),
        "monotone": all(a >= b for a, b in itertools.pairwise(curve)),
        "envelope": env,
        "single_session_tps": curve[0],
        "n_ok": n_ok,
        "floor": floor,
        "foreign_cpu_cores": cpu.foreign_cores,
    }


def ramp(
    api: Api, wl: Workload, policy: str, rep: int, floor: float, run_s: float
) -> dict[str, Any]:
    run = fresh_run(api, wl, f"{policy}-{rep}")
    pool = run.pool
    gated = policy.startswith("p7")
    if gated:
        api.post(
            f"/polykv/pools/{pool}/admission",
            {
                "target_tps_per_session": floor,
                "mode": "enforced",
                "on_saturation": "reject",
                "guarantee_min_sessions": 1,
                "settle_tokens": SETTLE_TOKENS,
                "settle_max_ms": SETTLE_MAX_MS,
            },
        )
    events: list[dict[str, Any]] = []
    backoff_until = 0.0
    pace: dict[str, int] = {}  # p7-paced: each agent's finished turns at the last spawn
    _, m0 = H.scrape_metrics(api.client, api.base_url)
    with Sampler(api, run.agents) as sampler, H.CpuWatch([api.pid]) as cpu:
        t0 = time.monotonic()
        next_tick = t0
        while (now := time.monotonic()) < t0 + run_s:
            if now < next_tick:
                time.sleep(min(0.05, next_tick - now))
                continue
            next_tick += TICK_S
            # A rejected spawn tells the orchestrator how long to back off.
            for a in run.agents:
                if a.state == "rejected" and a.retry_after_s:
                    backoff_until = max(backoff_until, a.t_spawn + a.retry_after_s)
                    a.retry_after_s = 0.0
            live = run.live
            ev: dict[str, Any] = {"t": now - t0, "agents": len(live)}
            if len(live) >= N_PARALLEL:
                ev["decision"] = "full"
            elif gated:
                if now < backoff_until:
                    ev["decision"] = "backoff"
                elif any(a.state == "starting" for a in live):
                    ev["decision"] = "spawn pending"
                elif any(a.turns <= pace.get(a.session_id, -1) for a in live):
                    ev["decision"] = "pacing"
                else:
                    cap = api.get(f"/polykv/pools/{pool}/capacity")
                    ev.update(
                        reason=cap["reason"],
                        projected=cap["projected_mean_tps_if_admitted"],
                        mean=cap["mean_active_tps"],
                        drop_ewma=cap["drop_per_admit_ewma"],
                        idle_estimate=cap["projected_idle_estimate"],
                        n_warming=cap["n_warming"],
                        n_active=cap["n_active"],
                    )
                    if not cap["can_admit"]:
                        ev["decision"] = "wait"
                    elif cap["n_warming"] > 0:
                        ev["decision"] = "warming"  # spec §14.3: a warming session defers
                    else:
                        ev["decision"] = "spawn"
            else:
                snap = api.get("/polykv/tps")
                mean = float(snap["mean_active_tps"])
                n = sum(
                    1
                    for s in snap["sessions"]
                    if s["state"] == "decoding" and not s["warming"] and s["tps_ewma"] > 0
                )
                proj = mean if policy == "naive-raw" else (mean * n / (n + 1) if n else 0.0)
                ev.update(mean=mean, projected=proj, n_measured=n)
                ev["decision"] = "spawn" if n == 0 or proj >= floor else "wait"
            if ev["decision"] == "spawn":
                ev["agent"] = run.spawn().session_id
                if policy == "p7-paced":
                    pace = {a.session_id: a.turns for a in run.live}
            events.append(ev)
        t1 = time.monotonic()
        _, m1 = H.scrape_metrics(api.client, api.base_url)
        run.finish()
    samples = sampler.samples
    stats = under_floor(samples, floor, t0, t1)
    running = [a for a in run.agents if a.t_admitted]
    in_run = [s for s in samples if t0 <= s.t <= t1]
    peak = max((s.n_agents for s in in_run), default=0)
    span = [(a, min(b.t, t1) - a.t) for a, b in itertools.pairwise(in_run)]
    mean_agents = sum(a.n_agents * dt for a, dt in span) / max(sum(dt for _, dt in span), 1e-9)
    decoded = counter(m1, "polykv_tokens_decoded_total") - counter(
        m0, "polykv_tokens_decoded_total"
    )
    out = {
        "policy": policy,
        "rep": rep,
        "pool": pool,
        "floor": floor,
        "run_s": t1 - t0,
        **stats,
        "peak_agents": peak,
        "mean_agents": mean_agents,
        "spawn_attempts": len(run.agents),
        "admitted": len(running),
        "rejected": sum(1 for a in run.agents if a.state == "rejected"),
        "reject_reasons": sorted({a.reject_reason for a in run.agents if a.reject_reason}),
        "holds": counter(m1, "polykv_pool_holds_total", pool)
        - counter(m0, "polykv_pool_holds_total", pool),
        "admit_wait_s": [a.t_admitted - a.t_spawn for a in running],
        "aggregate_decode_tps": decoded / (t1 - t0),
        "agent_tps": [a.tokens / a.decode_s for a in running if a.decode_s > 0],
        "foreign_cpu_cores": cpu.foreign_cores,
        "events": events,
        "samples": [
            [round(s.t - t0, 2), round(s.mean, 2), s.n_measured, s.n_warming, s.n_agents]
            for s in samples
            if t0 <= s.t <= t1
        ],
    }
    api.reset(N_PARALLEL, keep=(TRUNK,))
    return out


# ---------------------------------------------------------------------------- the benchmark


@dataclass
class Config:
    reps: int = 3
    run_s: float = RUN_S
    policies: tuple[str, ...] = POLICIES
    prefix_tokens: int = PREFIX_TOKENS
    floor: float | None = None  # skip the calibration and use this floor
    n_ok: int | None = None
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)

    def engine_args(self) -> list[str]:
        return [
            *("-np", str(N_PARALLEL), "-c", str(CTX), "-t", str(self.threads)),
            *("-fa", "off", "--metrics"),
        ]


def measure(cfg: Config) -> dict[str, Any]:
    model = H.bench_model()
    env = R.environment()
    model_info = {
        "path": str(model.relative_to(H.REPO_ROOT) if model.is_relative_to(H.REPO_ROOT) else model),
        "bytes": model.stat().st_size,
        "sha256_16": H.file_digest(model),
    }
    env["cpu_busy_cores_before"] = round(H.wait_for_quiet(max_busy_cores=0.5, max_wait_s=20), 2)
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(H.http_client(120.0))
        eng = stack.enter_context(H.engine(NAME, model, cfg.engine_args()))
        assert eng.proc is not None
        api = Api(client, eng.base_url, eng.proc.pid)
        wl = make_workload(api, cfg.prefix_tokens, 20_000)
        api.create_pool(TRUNK, wl.prefix)
        apis = dict.fromkeys(cfg.policies, api)
        by_flags: dict[tuple[str, ...], Api] = {}
        for policy in cfg.policies:
            flags = ENGINE_FLAGS.get(policy)
            if flags is None:
                continue
            if flags not in by_flags:
                # Idle while another runs (its compute threads sleep): runs stay sequential.
                eng2 = stack.enter_context(
                    H.engine(f"{NAME}-{policy}", model, [*cfg.engine_args(), *flags])
                )
                assert eng2.proc is not None
                by_flags[flags] = Api(client, eng2.base_url, eng2.proc.pid)
                by_flags[flags].create_pool(TRUNK, wl.prefix)
            apis[policy] = by_flags[flags]
        if cfg.floor is None:
            H.progress("calibrating the floor")
            cal = calibrate(api, wl)
        else:
            cal = {"floor": cfg.floor, "n_ok": cfg.n_ok or SAT_RANGE[0], "levels": []}
        floor = float(cal["floor"])
        H.progress(f"floor {floor:.1f} tok/s per session; supports {cal['n_ok']} agents")

        def one_rep(rep: int) -> None:
            if rep:
                H.wait_for_quiet(max_busy_cores=0.5, max_wait_s=10)
            order = cfg.policies if rep % 2 == 0 else cfg.policies[::-1]
            for policy in order:
                r = ramp(apis[policy], wl, policy, rep, floor, cfg.run_s)
                runs.append(r)
                H.progress(
                    f"  {policy:<10} under floor {r['under_s']:5.1f} s "
                    f"of {r['measured_s']:5.1f} s, "
                    f"dip {r['deepest_dip'] or 0:5.1f}, peak {r['peak_agents']} agents, "
                    f"{r['rejected']} rejected, aggregate {r['aggregate_decode_tps']:.0f} tok/s, "
                    f"others used {r['foreign_cpu_cores']:.2f} cores"
                )

        H.repeat(one_rep, cfg.reps, "spawn ramp")
    return {"env": env, "model": model_info, "calibration": cal, "runs": runs}


# ---------------------------------------------------------------------------- analysis


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = raw["runs"]
    n_ok = int(raw["calibration"]["n_ok"])
    out: dict[str, Any] = {"policies": {}, "targets": {}}

    def at(policy: str) -> list[dict[str, Any]]:
        return sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["rep"])

    for policy in cfg.policies:
        rs = at(policy)
        if not rs:
            continue
        agent_tps = [statistics.median(r["agent_tps"]) for r in rs if r["agent_tps"]]
        out["policies"][policy] = {
            "under_s": H.summarize([r["under_s"] for r in rs]).as_dict(),
            "under_share": H.summarize([r["under_share"] for r in rs]).as_dict(),
            "measured_s": H.summarize([r["measured_s"] for r in rs]).as_dict(),
            "deepest_dip": H.summarize([r["deepest_dip"] or 0.0 for r in rs]).as_dict(),
            "time_mean_tps": H.summarize([r["time_mean_tps"] or 0.0 for r in rs]).as_dict(),
            "peak_agents": H.summarize([r["peak_agents"] for r in rs]).as_dict(),
            "overshoot": H.summarize([max(0, r["peak_agents"] - n_ok) for r in rs]).as_dict(),
            "mean_agents": H.summarize([r["mean_agents"] for r in rs]).as_dict(),
            "rejected": H.summarize([r["rejected"] for r in rs]).as_dict(),
            "holds": H.summarize([r["holds"] for r in rs]).as_dict(),
            "aggregate_decode_tps": H.summarize([r["aggregate_decode_tps"] for r in rs]).as_dict(),
            "agent_tps_median": H.summarize(agent_tps).as_dict() if agent_tps else None,
            "foreign_cpu_cores": H.summarize([r["foreign_cpu_cores"] for r in rs]).as_dict(),
        }
    p7 = out["policies"].get("p7")
    for naive in ("naive-raw", "naive-proj"):
        base = out["policies"].get(naive)
        if not p7 or not base:
            continue
        b_med = base["under_s"]["median"]
        row: dict[str, Any] = {
            "baseline": naive,
            "naive_under_s": b_med,
            "p7_under_s": p7["under_s"]["median"],
            "limit_reduction": TARGET_REDUCTION,
        }
        if b_med > 0:
            reduction = 1.0 - p7["under_s"]["median"] / b_med
            paired = [
                1.0 - x["under_s"] / y["under_s"]
                for x in at("p7")
                for y in at(naive)
                if x["rep"] == y["rep"] and y["under_s"] > 0
            ]
            row.update(
                reduction=reduction,
                paired_reduction=H.summarize(paired).as_dict() if paired else None,
                met=reduction >= TARGET_REDUCTION,
            )
        else:
            row.update(reduction=None, met=None)  # the naive gate never went under
        out["targets"][naive] = row
    return out


# ---------------------------------------------------------------------------- report

POLICY_LABELS = {
    "naive-raw": "naive gate: raw mean ≥ floor",
    "naive-proj": "naive gate: raw mean × n/(n+1) ≥ floor",
    "p7-live": "floor admission, live projection (only sessions decoding now)",
    "p7-paced": "floor admission, live projection + pacing (a full turn of every agent between "
    "spawns)",
    "p7-step-cap": "floor admission, capped by decode-only step times (the previous cap)",
    "p7": "floor admission as shipped: pause-aware projection, capped by token-to-token times",
}
# The same policies in the notes under the tables.
POLICY_SHORT = {
    "p7-live": "live projection",
    "p7-paced": "live projection + pacing",
    "p7-step-cap": "step-time cap",
    "p7": "as shipped",
}


def _pct(x: float) -> str:
    return str(round(100 * x))  # no "-0"


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    cal = raw["calibration"]
    env = raw["env"]
    floor = float(cal["floor"])
    lines = [
        "### Spawn ramp: naive gate vs floor admission",
        "",
        f"Bench model `{Path(raw['model']['path']).name}`, `-np {N_PARALLEL} -c {CTX} -t "
        f"{cfg.threads} -fa off`. Agents share a {cfg.prefix_tokens}-token pool (a fresh fork "
        f"per run) and loop: a turn of {TURN_TOKENS} tokens, a {PAUSE_S[0]}–{PAUSE_S[1]} s "
        f"pause (tool call), the next turn with a {TOOL_TOKENS}-token tool answer (context: a "
        f"rolling window of the last exchange). The orchestrator ticks every {TICK_S:.0f} s "
        f"and may start one agent per tick; agents run to the end of the {cfg.run_s:.0f} s run. "
        f"Median (min–max) of {cfg.reps} repeats; time under the floor = seconds in which "
        "`mean_active_tps` (sampled every 0.2 s from `GET /polykv/tps`) was below the floor "
        "while at least one session had a measurement.",
        "",
    ]
    if cal.get("levels"):
        together = ", ".join(
            f"{lv['n']}: {lv['all_decoding_tps']:.1f}"
            for lv in cal["levels"]
            if lv.get("all_decoding_tps")
        )
        time_mean = ", ".join(
            f"{lv['n']}: {lv['mean_tps']:.1f}" for lv in cal["levels"] if lv["mean_tps"]
        )
        lines += [
            f"Calibration ({cal.get('passes', 1)} pass(es); agents: median mean_active_tps "
            f"while all of them decode at once, no gate, over every pass's readings): "
            f"{together}{'' if cal.get('monotone', True) else ' (not monotone: enveloped)'}; "
            f"time-means, tool-call pauses included: {time_mean}. Floor "
            f"**{floor:.1f} tok/s** per session, midway (geometric) across the sharpest drop "
            f"of the curve between {SAT_RANGE[0]} and {SAT_RANGE[1]} agents, so this CPU "
            f"supports **{cal['n_ok']}** agents above it with their turns aligned (overshoot "
            "counts agents beyond that).",
            "",
        ]
        curves = [
            (key, what)
            for key, what in (
                ("step_ceiling_tps", "decode-only steps, 1 / t(b)"),
                ("cycle_ceiling_tps", "token to token, any step, 1 / c(b): admission's cap"),
            )
            if cal.get(key)
        ]
        if curves:
            text = "; ".join(
                f"{what}: " + ", ".join(f"{b}: {r:.1f}" for b, r in cal[key].items())
                for key, what in curves
            )
            lines += [
                "The engine's own step-time curves after the calibration, as rates per "
                f"session at b decoding ({text}).",
                "",
            ]
    else:
        lines += [f"Floor {floor:.1f} tok/s given on the command line; n_ok = {cal['n_ok']}.", ""]
    headers = [
        "policy",
        "time under floor (s)",
        "share of measured time",
        "deepest dip (tok/s)",
        "time-mean tps",
        "peak agents",
        "overshoot",
        "mean agents",
        "429s",
        "aggregate decode tok/s",
    ]
    rows = []
    for policy in cfg.policies:
        p = res["policies"].get(policy)
        if not p:
            continue
        rows.append(
            [
                POLICY_LABELS[policy],
                R.fmt(p["under_s"], 1),
                R.fmt(p["under_share"], 0, 100, "%"),
                R.fmt(p["deepest_dip"], 1),
                R.fmt(p["time_mean_tps"], 1),
                R.fmt(p["peak_agents"]),
                R.fmt(p["overshoot"]),
                R.fmt(p["mean_agents"], 1),
                R.fmt(p["rejected"]),
                R.fmt(p["aggregate_decode_tps"]),
            ]
        )
    lines += [R.markdown_table(headers, rows), ""]
    rows = []
    for naive, t in res["targets"].items():
        if t["met"] is None:
            measured = (
                f"the naive gate never went under the floor (floor admission: "
                f"{t['p7_under_s']:.1f} s)"
            )
            verdict = "not measurable"
        else:
            pr = t.get("paired_reduction")
            measured = (
                f"{_pct(t['reduction'])}% lower ({t['naive_under_s']:.1f} s → "
                f"{t['p7_under_s']:.1f} s)"
                + (f"; per repeat {_pct(pr['min'])} to {_pct(pr['max'])}%" if pr else "")
            )
            verdict = "**met**" if t["met"] else "**missed**"
        rows.append(
            [
                f"floor admission's time under the floor ≥ {100 * TARGET_REDUCTION:.0f}% lower "
                f"than the "
                f"{POLICY_LABELS[naive]}",
                measured,
                verdict,
            ]
        )
    if rows:
        lines += [R.markdown_table(["target", "measured", "verdict"], rows), ""]
    lines += _p7_notes(raw, res)
    foreign = [r["foreign_cpu_cores"] for r in raw["runs"]]
    lines += [
        R.provenance(
            NAME,
            env,
            foreign,
            note="The raw numbers hold every tick's decision and every 0.2 s sample.",
            command=f"python -m bench.{NAME}{'' if cfg.reps == 3 else f' --reps {cfg.reps}'}",
        ),
    ]
    return "\n".join(lines)


def _p7_notes(raw: dict[str, Any], res: dict[str, Any]) -> list[str]:
    """What the gated policies' own answers said: why they waited, what they projected, and
    which fix of the live projection the measurement favours."""
    out: list[str] = []
    pols = res["policies"]
    fixes = [p for p in ("p7-live", "p7-paced", "p7-step-cap", "p7") if p in pols]
    if len(fixes) > 1:
        parts = [
            f"{POLICY_SHORT[p]} {pols[p]['under_s']['median']:.1f} s under the floor with "
            f"{pols[p]['mean_agents']['median']:.1f} agents on average "
            f"({pols[p]['aggregate_decode_tps']['median']:.0f} tok/s aggregate)"
            for p in fixes
        ]
        out += ["The gated policies side by side (medians): " + "; ".join(parts) + ".", ""]
    for policy in fixes:
        runs = sorted((r for r in raw["runs"] if r["policy"] == policy), key=lambda r: r["rep"])
        asked = [e for r in runs for e in r["events"] if "reason" in e]
        refused: dict[str, int] = {}
        for e in asked:
            if e["decision"] != "spawn":
                refused[e["reason"]] = refused.get(e["reason"], 0) + 1
        admits = []
        for r in runs:
            spawns = [e for e in r["events"] if e["decision"] == "spawn"]
            for e in spawns[1:]:
                if e.get("projected") is None:
                    admits.append(f"run {r['rep'] + 1} at {e['t']:.0f} s: unprojected")
                else:
                    admits.append(
                        f"run {r['rep'] + 1} at {e['t']:.0f} s: {e['n_active']} of "
                        f"{e['agents']} decoding at {e['mean']:.1f}, projected "
                        f"{e['projected']:.1f}"
                    )
        text = (
            f"{POLICY_SHORT[policy].capitalize()}: of {len(asked)} `/capacity` polls, "
            + (
                ", ".join(
                    f"{n} × “{why}”" for why, n in sorted(refused.items(), key=lambda x: -x[1])
                )
                or "none"
            )
            + f" refused a spawn; {sum(1 for e in asked if e['decision'] == 'spawn')} admitted"
            + (" (" + "; ".join(admits) + ")" if admits else "")
            + "."
        )
        out += [text, ""]
    return out


# ---------------------------------------------------------------------------- entry point


def _policies(text: str) -> tuple[str, ...]:
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = sorted(set(chosen) - set(POLICIES))
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"policies are a subset of {', '.join(POLICIES)}")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spawn_ramp", description=__doc__)
    p.add_argument("--reps", type=int, default=3, help="repeats per policy (default 3)")
    p.add_argument("--run-s", type=float, default=RUN_S, help="length of one ramp run")
    p.add_argument("--policies", type=_policies, default=POLICIES, help=f"of {','.join(POLICIES)}")
    p.add_argument("--prefix-tokens", type=int, default=PREFIX_TOKENS, help="shared pool size")
    p.add_argument("--floor", type=float, help="skip the calibration: use this floor (tok/s)")
    p.add_argument("--n-ok", type=int, help="with --floor: agents the floor supports")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="-t for the engine")
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render, charts=chart)) is not None:
        return rc
    cfg = Config(
        reps=args.reps,
        run_s=args.run_s,
        policies=args.policies,
        prefix_tokens=args.prefix_tokens,
        floor=args.floor,
        n_ok=args.n_ok,
        threads=args.threads,
    )
    if args.quick:
        cfg.reps, cfg.run_s, cfg.prefix_tokens = 1, 20.0, 400
    if cfg.reps < 1 or cfg.run_s < 10 or not 200 <= cfg.prefix_tokens <= 8000:
        p.error("--reps >= 1, --run-s >= 10, --prefix-tokens in 200..8000")
    return R.run_and_publish(NAME, cfg, args, measure, analyse, render, charts=chart)


def chart(data: Mapping[str, Any], out_dir: Path) -> list[Path]:
    from . import charts  # matplotlib only where charts are drawn

    return charts.ramp(data, out_dir, POLICY_LABELS)


if __name__ == "__main__":
    raise SystemExit(main())
