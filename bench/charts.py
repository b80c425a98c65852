"""Charts committed beside the benchmark results, where a picture says more than a table.

matplotlib with the Agg backend (files only, no display). Each function takes the results
document a benchmark wrote (its JSON) and returns the PNGs it wrote; ``report.publish`` links them
under the benchmark's table.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: never look for a display
import matplotlib.pyplot as plt

DPI = 110


def ramp(data: Mapping[str, Any], out_dir: Path, labels: Mapping[str, str]) -> list[Path]:
    """Spawn ramp: mean_active_tps against the floor over one run of each policy (the run
    whose time under the floor is the policy's median), with the agent count beneath."""
    runs: Sequence[dict[str, Any]] = data["runs"]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    if not policies:
        return []
    fig, axes = plt.subplots(
        len(policies), 1, figsize=(9, 2.2 * len(policies)), sharex=True, squeeze=False
    )
    for ax, policy in zip(axes[:, 0], policies, strict=True):
        mine = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["under_s"])
        run = mine[len(mine) // 2]
        t = [s[0] for s in run["samples"]]
        mean = [s[1] if s[2] > 0 else float("nan") for s in run["samples"]]
        agents = [s[4] for s in run["samples"]]
        ax.plot(t, mean, lw=1.0, color="tab:blue", label="mean_active_tps")
        ax.axhline(run["floor"], color="tab:red", lw=1.0, ls="--", label="floor")
        ax.set_ylabel("tok/s")
        ax.set_title(
            f"{labels.get(policy, policy)}: {run['under_s']:.1f} s under the floor",
            fontsize=9,
            loc="left",
        )
        twin = ax.twinx()
        twin.step(t, agents, where="post", color="tab:gray", lw=1.0, alpha=0.7)
        twin.set_ylabel("agents", color="tab:gray")
        twin.set_ylim(0, max(agents, default=1) + 1)
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds into the run")
    return [_save(fig, out_dir / "spawn_ramp.png")]


def first_token_per_agent(
    data: Mapping[str, Any],
    out_dir: Path,
    filename: str,
    labels: Mapping[str, str],
    arrivals: Mapping[str, str],
) -> list[Path]:
    """Shared prefix: each agent's time to first token (median over the repetitions, min–max
    as a band), one series per server; a row of panels per model, a column per arrival."""
    runs: Sequence[dict[str, Any]] = data.get("shared_runs") or []
    models = list(dict.fromkeys(r["model"] for r in runs))
    cols = [a for a in arrivals if any(r["arrival"] == a for r in runs)]
    if not models or not cols:
        return []
    cfg = data.get("config") or {}
    ticks = range(1, max(len(r["agents"]) for r in runs) + 1)
    fig, axes = plt.subplots(
        len(models), len(cols), figsize=(5.2 * len(cols), 3.4 * len(models)), squeeze=False
    )
    for row, model in enumerate(models):
        for col, arrival in enumerate(cols):
            ax = axes[row, col]
            for key, label in labels.items():
                mine = [
                    r
                    for r in runs
                    if r["model"] == model and r["arrival"] == arrival and r["server"] == key
                ]
                if not mine:
                    continue
                n = min(len(r["agents"]) for r in mine)
                x = list(range(1, n + 1))
                per = [sorted(float(r["agents"][i]["ttft_s"]) for r in mine) for i in range(n)]
                med = [statistics.median(v) for v in per]
                (line,) = ax.plot(x, med, marker="o", ms=3.5, lw=1.2, label=label)
                if len(mine) > 1:
                    lo, hi = [v[0] for v in per], [v[-1] for v in per]
                    ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
            title = arrivals[arrival]
            if arrival == "staggered" and cfg.get("stagger_s"):
                title += f" (one agent every {cfg['stagger_s']:g} s)"
            ax.set_title(f"{model}: {title}", fontsize=9, loc="left")
            ax.set_xlabel("agent (in arrival order)")
            ax.set_ylabel("time to first token (s, log)")
            ax.set_yscale("log")  # the servers can differ tenfold and more
            ax.set_xticks(list(ticks))
            ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(loc="best", fontsize=8)
    return [_save(fig, out_dir / filename)]


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def tps_against_floor(
    series: Mapping[str, Sequence[Sequence[Any]]], floor: float, path: Path, title: str
) -> list[Path]:
    """Mean tokens/s of the sessions decoding over a run, one panel per server, against the
    floor; how many decode beneath. ``series``: label -> [(t, mean or None, n decoding)]."""
    if not series:
        return []
    fig, axes = plt.subplots(
        len(series), 1, figsize=(9, 2.4 * len(series)), sharex=True, squeeze=False
    )
    top = max((s[1] for pts in series.values() for s in pts if s[1] is not None), default=floor)
    for ax, (label, pts) in zip(axes[:, 0], series.items(), strict=True):
        t = [s[0] for s in pts]
        mean = [s[1] if s[1] is not None else float("nan") for s in pts]
        ax.plot(t, mean, lw=1.0, color="tab:blue", label="mean tok/s, sessions decoding")
        ax.axhline(floor, color="tab:red", lw=1.0, ls="--", label=f"floor {floor:g} tok/s")
        ax.set_ylim(0, top * 1.05)
        ax.set_ylabel("tok/s")
        ax.set_title(label, fontsize=9, loc="left")
        twin = ax.twinx()
        twin.step(t, [s[2] for s in pts], where="post", color="tab:gray", lw=0.8, alpha=0.6)
        twin.set_ylabel("decoding", color="tab:gray")
        twin.set_ylim(0, max((s[2] for s in pts), default=1) + 1)
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds into the run")
    fig.suptitle(title, fontsize=9)
    return [_save(fig, path)]
