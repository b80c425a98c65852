"""Plumbing every PolyKV benchmark shares.

* servers: the engine (``polykv_engine.testing.EngineProcess``) and any other HTTP server
  started from a command line (``ServerProcess``), each on a free port, logging to
  ``bench/results/<label>.log`` (git-ignored);
* clients: streamed completions timed per event (``sse_events``), k requests released at
  the same instant (``run_together``), Prometheus scrapes (``scrape_metrics``);
* statistics: repeat-and-summarise (``Summary``: median, min, max, spread);
* noise accounting: how many cores *other* processes used while we measured (``CpuWatch``,
  ``TreeCpuWatch``).

What the benchmarks send is in :mod:`bench.workload`, the engine's routes they call in
:mod:`bench.engine_client`, and what they write in :mod:`bench.report`.

Progress goes to stderr; the final table goes to stdout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from polykv_engine.llama.omp import ENV as OMP_ENV
from polykv_engine.llama.omp import apply_omp_policy
from polykv_engine.testing import EngineProcess, free_port

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
MODEL_ENV = "POLYKV_BENCH_MODEL"
DEFAULT_MODEL = REPO_ROOT / "models" / "polykv-bench.gguf"

# The servers under test each load a libllama of one llama.cpp tree (the wheel's patched, or
# a llama-server build); give their OpenMP runtimes the same policy:
# the one the engine ships with (or the one POLYKV_OMP_WAIT_POLICY names, as for the engine),
# resolved for this machine's CPUs (bench/vs_llama_server.py gives it to every column).
SERVER_ENV: dict[str, str] = {}
OMP_CHOICE = apply_omp_policy(SERVER_ENV, os.environ.get(OMP_ENV))

_T0 = time.monotonic()


class BenchError(RuntimeError):
    """A benchmark could not produce a valid measurement."""


def progress(msg: str) -> None:
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- statistics


@dataclass(frozen=True, slots=True)
class Summary:
    """Repeated measurements of one quantity."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    @property
    def spread_pct(self) -> float:
        """(max - min) / median, in percent: how much the repeats disagree."""
        m = self.median
        return 100.0 * (self.hi - self.lo) / abs(m) if m else 0.0

    def fmt(self, digits: int = 0, scale: float = 1.0, unit: str = "") -> str:
        """``median (min–max)``; a single value prints alone."""
        f = f"{{:.{digits}f}}"
        med = f.format(self.median * scale) + unit
        if len(self.values) < 2:
            return med
        return f"{med} ({f.format(self.lo * scale)}–{f.format(self.hi * scale)})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "min": self.lo,
            "max": self.hi,
            "spread_pct": round(self.spread_pct, 2),
            "n": len(self.values),
            "values": list(self.values),
        }


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        raise BenchError("nothing to summarise")
    return Summary(tuple(float(v) for v in values))


def repeat(fn: Callable[[int], T], reps: int, label: str) -> list[T]:
    """Call ``fn(rep)`` ``reps`` times, with progress."""
    out: list[T] = []
    for rep in range(reps):
        progress(f"{label}: repeat {rep + 1}/{reps}")
        out.append(fn(rep))
    return out


def merged_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of the union of [start, end] intervals."""
    total = 0.0
    cur_s: float | None = None
    cur_e = 0.0
    for s, e in sorted(intervals):
        if cur_s is None or s > cur_e:
            if cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_s is not None:
        total += cur_e - cur_s
    return total


# ---------------------------------------------------------------------------- CPU noise


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: idle and iowait are not busy.
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)


def _pid_jiffies(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return 0
    # Fields after the ")" of the command name: utime and stime are the 12th and 13th.
    rest = raw.rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])


_HZ = os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class CpuWatch:
    """Cores used by this process + the servers under test, and by everything else."""

    pids: Sequence[int]
    own_cores: float = 0.0
    foreign_cores: float = 0.0
    own_cpu_s: float = 0.0
    _t: float = 0.0
    _busy: int = 0
    _own: int = 0

    def _own_now(self) -> int:
        return sum(_pid_jiffies(p) for p in {os.getpid(), *self.pids})

    def __enter__(self) -> CpuWatch:
        self._t = time.monotonic()
        self._busy = _busy_jiffies()
        self._own = self._own_now()
        return self

    def __exit__(self, *exc: object) -> None:
        dt = max(time.monotonic() - self._t, 1e-6)
        busy = (_busy_jiffies() - self._busy) / _HZ
        own = self.own_cpu_s = (self._own_now() - self._own) / _HZ
        self.own_cores = own / dt
        self.foreign_cores = max(busy - own, 0.0) / dt


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """``root`` and every process below it, from a pid -> parent pid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU jiffies of the process and of its children it has reaped)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        # After the command name: ppid is the 2nd field; utime, stime, cutime, cstime 12-15.
        table[int(entry.name)] = (int(rest[1]), sum(int(x) for x in rest[11:15]))
    return table


@dataclass(slots=True)
class TreeCpuWatch(CpuWatch):
    """Cores used by this process and every process it started (a whole control plane and
    the pods it runs; one that ended meanwhile counts once its parent reaped it), and by
    everything else."""

    pids: Sequence[int] = ()

    def _own_now(self) -> int:
        table = _process_table()
        tree = descendants({pid: row[0] for pid, row in table.items()}, os.getpid())
        return sum(table[pid][1] for pid in tree if pid in table)


def cpu_busy_now(seconds: float = 1.0) -> float:
    """Cores busy (all processes) over the next ``seconds``."""
    b0, t0 = _busy_jiffies(), time.monotonic()
    time.sleep(seconds)
    return (_busy_jiffies() - b0) / _HZ / (time.monotonic() - t0)


def wait_for_quiet(max_busy_cores: float, max_wait_s: float) -> float:
    """Wait (bounded) until other work leaves the CPU mostly idle; returns the last reading."""
    deadline = time.monotonic() + max_wait_s
    busy = cpu_busy_now()
    while busy > max_busy_cores and time.monotonic() < deadline:
        progress(f"CPU busy with other work ({busy:.2f} cores); waiting for it to settle")
        time.sleep(4.0)
        busy = cpu_busy_now()
    return busy


# ---------------------------------------------------------------------------- servers


def bench_model() -> Path:
    """The benchmark model: $POLYKV_BENCH_MODEL, else models/polykv-bench.gguf (made if absent)."""
    env = os.environ.get(MODEL_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise BenchError(f"{MODEL_ENV}={env}: no such file")
        return path
    if not DEFAULT_MODEL.is_file():
        progress(f"{DEFAULT_MODEL.relative_to(REPO_ROOT)} missing: running scripts/models.sh")
        subprocess.run([str(REPO_ROOT / "scripts" / "models.sh")], check=True, cwd=REPO_ROOT)
    return DEFAULT_MODEL


def real_model(name: str) -> Path:
    """A real GGUF by its polykv-fetch-model name (fetched into the user cache once)."""
    from polykv_engine.fetch_model import ensure

    return ensure(name)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _log_path(label: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{label}.log"
    path.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def engine(
    label: str, model: Path, args: Sequence[str], env: Mapping[str, str] | None = None
) -> Iterator[EngineProcess]:
    """A ``polykv-engine`` child process for the duration of the block."""
    eng = EngineProcess(
        model=model, args=list(args), log_path=_log_path(label), env=dict(env or SERVER_ENV)
    )
    progress(f"starting {label}: polykv-engine {' '.join(args)}")
    eng.start(timeout=180.0)
    try:
        yield eng
    finally:
        report_early_exit(label, eng.proc, eng.log_tail)
        eng.stop()


@contextlib.contextmanager
def paused(pids: Sequence[int]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) for the block: servers kept up between their turns
    take no CPU from the one measured, even one whose threads spin while idle."""
    stopped = []
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@dataclass
class ServerProcess:
    """Any HTTP server started from a command line; ``{port}`` in it is filled in."""

    label: str
    argv: Sequence[str]
    ready_path: str
    host: str = "127.0.0.1"
    port: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 180.0) -> None:
        self.port = self.port or free_port(self.host)
        self.log_path = _log_path(self.label)
        argv = [a.replace("{port}", str(self.port)) for a in self.argv]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.label} exited during startup:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + self.ready_path, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise BenchError(f"{self.label} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def server(proc: ServerProcess) -> Iterator[ServerProcess]:
    progress(f"starting {proc.label}")
    proc.start()
    try:
        yield proc
    finally:
        report_early_exit(proc.label, proc.proc, proc.log_tail)
        proc.stop()


def report_early_exit(
    label: str, proc: subprocess.Popen[bytes] | None, log_tail: Callable[[], str]
) -> None:
    """Say so when a server had exited before the benchmark was done with it: its clients
    then only see refused connections, and a crash (a negative status is the signal that
    ended it) must not pass for a network error."""
    if proc is None or proc.poll() is None:
        return
    progress(f"{label} (pid {proc.pid}) had exited with status {proc.returncode}; log tail:")
    progress(log_tail())


# ---------------------------------------------------------------------------- clients


def http_client(timeout_s: float = 600.0) -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(timeout_s), limits=httpx.Limits(max_connections=64))


def open_connections(client: httpx.Client, base: str, n: int) -> None:
    """Leave ``n`` kept-alive connections to ``base`` in ``client``'s pool, so that requests
    released together go out at once: without them each thread first connects, and on a
    machine whose cores the server's compute threads fill, the connects of the later threads
    trail the first request by up to a step (the server under test then starts that request
    alone, the others a step later, and what is measured is the arrival spread)."""
    gate = threading.Barrier(n)

    def hold() -> None:
        with client.stream("GET", f"{base}/health") as resp:
            gate.wait(60)  # every connection busy at once: none is reused by another thread
            resp.read()  # then back to the pool, kept alive

    with ThreadPoolExecutor(max_workers=n) as pool:
        for fut in [pool.submit(hold) for _ in range(n)]:
            fut.result()


def sse_events(
    client: httpx.Client, url: str, body: Mapping[str, Any]
) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST ``body`` and yield ``(perf_counter at arrival, payload)`` per SSE ``data:`` event."""
    with client.stream("POST", url, json=dict(body)) as resp:
        if resp.status_code != 200:
            resp.read()
            raise BenchError(f"POST {url} -> {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                continue
            payload = json.loads(data)
            if not isinstance(payload, dict):
                raise BenchError(f"unexpected SSE payload from {url}: {data[:200]}")
            if "error" in payload:
                raise BenchError(f"{url} streamed an error: {payload['error']}")
            yield time.perf_counter(), payload


def run_together(fns: Sequence[Callable[[], T]], on_released: Callable[[], None]) -> list[T]:
    """Run every ``fn`` in its own thread, all released at one instant.

    ``on_released`` runs on the calling thread right after the release, while the functions
    run (a benchmark uses it to sample server counters mid-flight). Exceptions propagate.
    """
    gate = threading.Barrier(len(fns) + 1)

    def gated(fn: Callable[[], T]) -> T:
        gate.wait()
        return fn()

    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        futures = [pool.submit(gated, fn) for fn in fns]
        gate.wait()
        try:
            on_released()
        finally:
            results = [f.result() for f in futures]
    return results


def scrape_metrics(client: httpx.Client, base_url: str) -> tuple[float, dict[str, float]]:
    """``(perf_counter at mid-request, {sample name with labels: value})`` from /metrics."""
    t0 = time.perf_counter()
    resp = client.get(f"{base_url}/metrics")
    t1 = time.perf_counter()
    resp.raise_for_status()
    samples: dict[str, float] = {}
    for line in resp.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            samples[name] = float(value)
    return (t0 + t1) / 2, samples
