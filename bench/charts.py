"""Charts committed beside the benchmark results, where a picture says more than a table.

matplotlib with the Agg backend (files only, no display). Each function takes the results
document a benchmark wrote (its JSON) and returns the PNGs it wrote; ``H.publish`` links them
under the benchmark's table.
"""

from __future__ import annotations

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


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
