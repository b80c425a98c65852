"""What every benchmark writes: ``bench/results/<name>.json`` (raw numbers, the summary, the
environment they were measured in) and its markdown table in ``docs/performance.md``
between ``<!-- bench:<name>:start -->`` / ``<!-- bench:<name>:end -->`` (never the front
page), with charts in ``docs/assets/bench/``; and the table cells shared by every
benchmark."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .harness import OMP_CHOICE, REPO_ROOT, RESULTS_DIR, Summary, progress

DOCS_PAGE = REPO_ROOT / "docs" / "performance.md"  # the tables; never the front page
CHARTS_DIR = REPO_ROOT / "docs" / "assets" / "bench"


def fmt(d: Mapping[str, Any] | None, digits: int = 0, scale: float = 1.0, unit: str = "") -> str:
    """A summary dict (``Summary.as_dict``) as a cell: median (min–max); "–" when absent."""
    return Summary(tuple(d["values"])).fmt(digits, scale, unit) if d else "–"


def med(d: Mapping[str, Any] | None, digits: int = 2, scale: float = 1.0, unit: str = "") -> str:
    """A summary dict's median alone; "–" when absent."""
    return f"{d['median'] * scale:.{digits}f}{unit}" if d else "–"


def environment() -> dict[str, Any]:
    """Where and on what the numbers were measured."""
    ids = cpuinfo_fields()
    cpu = ids.get("model name") or platform.processor() or platform.machine()

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    try:
        llama_version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        llama_version = "?"
    return {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        # The servers run from the working tree: note engine files that differ from the commit.
        "engine_uncommitted": git("status", "--porcelain", "--", "engine_image").splitlines(),
        "cpu": cpu,
        # A model name such as "AMD EPYC" covers several generations; the family tells them
        # apart, and the kernel paths are gated on it (scripts/patches/ggml-cpu-paths.patch).
        "cpu_family": cpu_family(ids),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()),
        "omp_wait_policy": OMP_CHOICE.policy,  # the servers' OpenMP threads between steps
        "python": platform.python_version(),
        "llama_cpp_python": llama_version,
        "platform": platform.platform(),
    }


def cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("vendor_id", "cpu family", "model",
    "model name", ...); {} where there is no /proc."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break  # the first processor's block is enough
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_family(ids: Mapping[str, str]) -> str:
    """The vendor's family and model from /proc/cpuinfo fields, as the vendors write them
    ("family 1Ah model 02h"); "" where the fields are missing (not x86, or no /proc)."""
    try:
        family, model = int(ids["cpu family"]), int(ids["model"])
    except (KeyError, ValueError):
        return ""
    return f"family {family:X}h model {model:02X}h"


def machine_name(env: Mapping[str, Any]) -> str:
    """The CPU as every table's caption names it: model name, and family where known."""
    family = env.get("cpu_family")
    return f"{env['cpu']} ({family})" if family else str(env["cpu"])


def result_name(name: str, model: str, default_model: str) -> str:
    """Where a benchmark's run on ``model`` is published: the default model's under the
    benchmark's own name (the front page may read it), any other model's beside it, so both
    tables stand."""
    if model == default_model:
        return name
    return f"{name}_" + re.sub(r"[^a-z0-9]+", "_", model.lower()).strip("_")


def command_line(name: str, model: str, default_model: str, extra: str = "") -> str:
    """How to run that benchmark again on ``model``."""
    cmd = f"python -m bench.{name}"
    if model != default_model:
        cmd += f" --model {model}"
    return cmd + (f" {extra}" if extra else "")


def provenance(
    name: str,
    env: Mapping[str, Any],
    foreign: Sequence[float] = (),
    note: str = "",
    command: str = "",
) -> str:
    """The line under a benchmark's tables: the machine and how busy it was (`foreign`: the
    cores other processes used, per run), what ran, and how to run it again."""
    machine = f"{machine_name(env)}, {env['cpu_count']} cores"
    if env.get("loadavg_at_start"):
        machine += f"; load average at start {env['loadavg_at_start'][0]:.2f}"
    if foreign:
        machine += (
            f"; other processes used {statistics.median(foreign):.2f} cores "
            f"(median, max {max(foreign):.2f}) while measuring"
        )
    if env.get("omp_wait_policy"):
        machine += f"; OpenMP wait policy {env['omp_wait_policy']}"
    run = (
        f"Commit {env['git_commit']}, {env['date_utc']}; `{command or f'python -m bench.{name}'}`, "
        f"raw numbers in `bench/results/{name}.json`."
    )
    return " ".join(p for p in (machine + ".", note, run) if p)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    aligns = ["---"] + ["--:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


BENCH_HEADING = "## Benchmarks"
_BENCH_INTRO = (
    "Measured by `make bench` (`python -m bench.run_all`) on the development machine and "
    "regenerated by each benchmark; raw numbers and medians are in `bench/results/`."
)


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def splice_tables(text: str, name: str, markdown: str) -> str:
    """Return the docs page with ``markdown`` between the benchmark's markers.

    The markers are replaced in place when present; otherwise they are appended to the
    "## Benchmarks" section, which is created at the end when absent. Nothing else changes.
    """
    start, end = _markers(name)
    block = f"{start}\n{markdown.strip()}\n{end}"
    i = text.find(start)
    j = text.find(end, i + len(start)) if i >= 0 else -1
    if i >= 0 and j >= 0:
        return text[:i] + block + text[j + len(end) :]
    heading = re.search(rf"^{re.escape(BENCH_HEADING)}[ \t]*$", text, re.MULTILINE)
    if heading is None:
        return text.rstrip("\n") + f"\n\n{BENCH_HEADING}\n\n{_BENCH_INTRO}\n\n{block}\n"
    nxt = re.search(r"^## ", text[heading.end() :], re.MULTILINE)
    cut = heading.end() + nxt.start() if nxt else len(text)
    before = text[:cut].rstrip("\n")
    after = text[cut:]
    return before + f"\n\n{block}\n" + (f"\n{after}" if after else "")


Charts = Callable[[Mapping[str, Any], Path], list[Path]]


def publish(
    name: str,
    data: Mapping[str, Any],
    markdown: str,
    page: Path | None = DOCS_PAGE,
    charts: Charts | None = None,
) -> None:
    """Write results/<name>.json, the charts, and (unless ``page`` is None) the table on the
    docs page, with the charts linked under it."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    progress(f"wrote bench/results/{name}.json")
    if page is None:
        return
    CHARTS_DIR.mkdir(parents=True, exist_ok=True)
    pngs = charts(data, CHARTS_DIR) if charts is not None else []
    for png in pngs:
        progress(f"wrote {png.relative_to(REPO_ROOT)}")
    rel = CHARTS_DIR.relative_to(page.parent)
    markdown = markdown.strip() + "".join(f"\n\n![{p.stem}]({rel}/{p.name})" for p in pngs)
    old = page.read_text()
    new = splice_tables(old, name, markdown)
    if new != old:
        page.write_text(new)
    progress(f"{page.relative_to(REPO_ROOT)}: table {name} updated")


def republish(
    name: str,
    data: dict[str, Any],
    cfg: Any,
    raw: dict[str, Any],
    analyse: Callable[[Any, dict[str, Any]], Any],
    render: Callable[[Any, dict[str, Any], Any], str],
    *,
    publish_files: bool,
    docs: bool,
    charts: Charts | None = None,
) -> int:
    """A saved measurement analysed and rendered again (``--from-json``): its environment
    and commit stay as recorded; only the summary, the tables and the charts are redone."""
    res = analyse(cfg, raw)
    table = render(cfg, raw, res)
    if publish_files:
        data["summary"] = res
        publish(name, data, table, page=DOCS_PAGE if docs else None, charts=charts)
    print(table)
    return 0


_META = ("benchmark", "config", "elapsed_s", "summary")  # what run_and_publish adds to raw


def from_json(
    name: str | Callable[[Any], str],
    args: Any,
    config: Callable[..., Any],
    analyse: Callable[[Any, dict[str, Any]], Any],
    render: Callable[[Any, dict[str, Any], Any], str],
    charts: Charts | None = None,
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> int | None:
    """``--from-json FILE``: a results file this benchmark wrote, analysed and rendered again
    (its environment and commit stay as recorded; JSON lists become the config's tuples;
    `transform`, when given, may add to it first; ``name`` may be a function of the config,
    for a benchmark that publishes each model apart). None when the flag is absent: measure."""
    if args.from_json is None:
        return None
    data = json.loads(args.from_json.read_text())
    if transform is not None:
        data = transform(data)
    cfg = config(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["config"].items()})
    if callable(name):
        name = name(cfg)
    raw = {k: v for k, v in data.items() if k not in _META}
    return republish(
        name,
        data,
        cfg,
        raw,
        analyse,
        render,
        publish_files=not args.no_publish,
        docs=not args.no_docs,
        charts=charts,
    )


def add_output_flags(p: Any) -> None:
    """The flags every benchmark shares: where its results go, or a saved result to render
    again instead of measuring."""
    p.add_argument("--no-docs", action="store_true", help="write the JSON only, not the docs page")
    p.add_argument("--no-publish", action="store_true", help="print only; write no files")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, short, no files")
    p.add_argument(
        "--from-json",
        type=Path,
        help="measure nothing: re-analyse and re-render a results file this benchmark wrote",
    )


def run_and_publish(
    name: str,
    cfg: Any,
    args: Any,
    measure: Callable[[Any], dict[str, Any]],
    analyse: Callable[[Any, dict[str, Any]], Any],
    render: Callable[[Any, dict[str, Any], Any], str],
    bulky: Sequence[str] = ("runs",),
    charts: Charts | None = None,
) -> int:
    """Measure, summarise, print the table, and publish it unless told not to. ``bulky`` raw
    entries go last in the JSON, after the summary a reader looks for first."""
    t0 = time.monotonic()
    raw = measure(cfg)
    res = analyse(cfg, raw)
    table = render(cfg, raw, res)
    data = {
        "benchmark": name,
        "config": dataclasses.asdict(cfg),
        "elapsed_s": round(time.monotonic() - t0, 1),
        **{k: v for k, v in raw.items() if k not in bulky},
        "summary": res,
        **{k: raw[k] for k in bulky},
    }
    if not (args.no_publish or args.quick):
        publish(name, data, table, page=None if args.no_docs else DOCS_PAGE, charts=charts)
    print(table)
    progress(f"done in {time.monotonic() - t0:.0f}s")
    return 0
