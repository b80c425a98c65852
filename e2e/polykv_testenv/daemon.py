"""The background process behind `polykv-dev up`: the control plane plus the process node,
until SIGTERM. Files under the dev directory:

    daemon.pid      this process: "<pid> <start ticks>"   daemon.log  its log
    info.json       written once ready                     cluster/    ControlPlane state
    processes.json  every process it started (pid, start ticks): what `down` may stop
    node/           pod logs and volumes                   (component logs: cluster/logs/)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from .cleanup import ledger
from .controlplane import ControlPlane
from .node import ProcessNode
from .procs import start_ticks

log = logging.getLogger("polykv.testenv.daemon")


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s", force=True
    )
    # Every probe and status write is an HTTP request; httpx logs each one at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def serve(dev_dir: Path, bin_dir: Path | None) -> int:
    dev_dir.mkdir(parents=True, exist_ok=True)
    info_path = dev_dir / "info.json"
    pid_path = dev_dir / "daemon.pid"
    info_path.unlink(missing_ok=True)
    pid_path.write_text(f"{os.getpid()} {start_ticks(os.getpid())}")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Pod logs and volumes of the previous run go; PVC directories (node/claims) stay.
    shutil.rmtree(dev_dir / "node" / "pods", ignore_errors=True)
    book = ledger(dev_dir)
    cluster = ControlPlane(dev_dir / "cluster", bin_dir, ledger=book)
    node: ProcessNode | None = None
    try:
        cluster.start()
        node = ProcessNode(cluster.credentials, dev_dir / "node", ledger=book)
        node.start()
        info = {
            "pid": os.getpid(),
            "server": cluster.server,
            "kubeconfig": str(cluster.kubeconfig),
            "node": node.name,
            "bin_dir": str(cluster.bin_dir),
            "logs": str(cluster.log_dir),
            "pod_logs": str(node.ctx.pods_dir),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        info_path.write_text(json.dumps(info, indent=2))
        log.info("ready: %s", info)
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        info_path.unlink(missing_ok=True)
        if node is not None:
            node.stop()
        cluster.stop()
        pid_path.unlink(missing_ok=True)
        log.info("stopped")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m polykv_testenv.daemon")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--bin-dir", type=Path)
    args = p.parse_args()
    configure_logging()
    raise SystemExit(serve(args.dir, args.bin_dir))


if __name__ == "__main__":
    main()
