"""The chart and the helm binary built with the local control plane (scripts/build-k8s.sh)."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from polykv_testenv.bins import ensure_binaries

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "polykv"


@functools.cache
def bin_dir() -> Path:
    return ensure_binaries()


OFFLINE = Path(__file__).parent / "fixtures" / "offline.yaml"


def helm(*args: str, check: bool = True, offline: bool = True) -> subprocess.CompletedProcess[str]:
    """helm with no cluster: its caches in a temporary home, no KUBECONFIG. `template` and
    `lint` read OFFLINE's values first (what the chart would read from a cluster; the
    caller's -f files and --set come later and win), unless `offline` is False."""
    if offline and args and args[0] in ("template", "lint"):
        args = (args[0], "-f", str(OFFLINE), *args[1:])
    home = Path(os.environ.get("TMPDIR", "/tmp")) / "polykv-helm-home"
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    out = subprocess.run(
        [str(bin_dir() / "helm"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out
