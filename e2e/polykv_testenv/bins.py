"""Finds the control-plane binaries, building them through scripts/build-k8s.sh."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger("polykv.testenv.bins")

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-k8s.sh"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "helm",
)


class BinariesMissing(RuntimeError):
    pass


def ensure_binaries() -> Path:
    """Returns the directory holding the binaries.

    POLYKV_K8S_BIN_DIR pointing at a complete directory is used as is (for machines without
    the repo's Go module). Otherwise the build script runs: seconds when its cache is
    current, tens of minutes cold (its progress goes to our stderr).
    """
    override = os.environ.get("POLYKV_K8S_BIN_DIR")
    if override and all((Path(override) / b).is_file() for b in BINARIES):
        return Path(override)
    if not BUILD_SCRIPT.is_file():
        raise BinariesMissing(f"no {BUILD_SCRIPT} and POLYKV_K8S_BIN_DIR is not set")
    log.info("locating control-plane binaries via %s", BUILD_SCRIPT)
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False
    )
    if out.returncode != 0:
        raise BinariesMissing(f"{BUILD_SCRIPT} failed with exit code {out.returncode}")
    bin_dir = Path(out.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise BinariesMissing(f"{bin_dir} lacks {missing}")
    return bin_dir
