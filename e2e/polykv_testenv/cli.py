"""`polykv-dev up|down|status`: the local control plane and process node in the background.

polykv-dev up        build (cached) and start; prints the KUBECONFIG to use
polykv-dev status    exit 0 when healthy, 1 when degraded, 3 when not running
polykv-dev down      stop everything (pods, node, control plane)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import daemon
from .bins import REPO_ROOT, ensure_binaries
from .cleanup import kill_leftovers
from .kubeapi import Credentials, Kube
from .procs import Recorded, kill_recorded, wait_pid_gone

NOT_RUNNING = 3


def default_dir() -> Path:
    env = os.environ.get("POLYKV_DEV_DIR")
    if env:
        return Path(env)
    return REPO_ROOT / ".run" / "k8s"


def _daemon(dev_dir: Path) -> Recorded | None:
    """The daemon of `dev_dir` if it runs: the pid it wrote, checked against the start time
    it wrote beside it (a reused pid is somebody else's process)."""
    try:
        pid, start = (int(x) for x in (dev_dir / "daemon.pid").read_text().split())
    except (OSError, ValueError):
        return None
    found = Recorded(pid, start, "daemon")
    return found if found.alive() else None


def _running_pid(dev_dir: Path) -> int | None:
    found = _daemon(dev_dir)
    return found.pid if found is not None else None


def _info(dev_dir: Path) -> dict[str, Any] | None:
    try:
        info: dict[str, Any] = json.loads((dev_dir / "info.json").read_text())
    except (OSError, ValueError):
        return None
    return info


def _print_ready(info: dict[str, Any]) -> None:
    print(f"control plane: {info['server']} (daemon pid {info['pid']})")
    print(f"process node:  {info['node']}")
    print(f"logs:          {info['logs']}  (pods: {info['pod_logs']})")
    print(f"kubectl:       {info['bin_dir']}/kubectl")
    print(f"export KUBECONFIG={info['kubeconfig']}")


def up(dev_dir: Path, foreground: bool, timeout_s: float) -> int:
    if _running_pid(dev_dir) is not None:
        info = _info(dev_dir)
        if info is not None:
            print("already running")
            _print_ready(info)
            return 0
        print(f"a daemon is starting or stuck; see {dev_dir / 'daemon.log'}", file=sys.stderr)
        return 1
    stale = kill_leftovers(dev_dir)
    if stale:
        print(f"killed {stale} process(es) left by a previous daemon", file=sys.stderr)
    # Build (or find) the binaries here, so a cold build's progress shows in this terminal.
    bin_dir = ensure_binaries()
    if foreground:
        daemon.configure_logging()
        return daemon.serve(dev_dir, bin_dir)
    dev_dir.mkdir(parents=True, exist_ok=True)
    (dev_dir / "info.json").unlink(missing_ok=True)
    log_path = dev_dir / "daemon.log"
    argv = [sys.executable, "-m", "polykv_testenv.daemon", "--dir", str(dev_dir)]
    argv += ["--bin-dir", str(bin_dir)]
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    print(f"starting (log: {log_path}) ...", flush=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = _info(dev_dir)
        if info is not None:
            _print_ready(info)
            return 0
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-30:]
            print("\n".join(tail), file=sys.stderr)
            print(f"daemon exited with {proc.returncode}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    print(f"not ready after {timeout_s:.0f}s; see {log_path}", file=sys.stderr)
    return 1


def down(dev_dir: Path) -> int:
    daemon = _daemon(dev_dir)
    pid = daemon.pid if daemon is not None else None
    if daemon is not None:
        os.kill(daemon.pid, signal.SIGTERM)
        if not wait_pid_gone(daemon.pid, 90):
            print(f"daemon {daemon.pid} did not stop in 90s; killing it", file=sys.stderr)
            kill_recorded(daemon)
            wait_pid_gone(daemon.pid, 10)
    # Whatever a crashed daemon left running (components, pods): only what it recorded.
    stale = kill_leftovers(dev_dir)
    if pid is None and not stale:
        print("not running")
    else:
        print("stopped" + (f" ({stale} leftover process(es) killed)" if stale else ""))
    return 0


def status(dev_dir: Path) -> int:
    pid = _running_pid(dev_dir)
    info = _info(dev_dir)
    if pid is None or info is None:
        print("not running" if pid is None else f"starting (daemon pid {pid})")
        return NOT_RUNNING
    pki = Path(info["kubeconfig"]).parent / "pki"
    api = Kube(
        Credentials(info["server"], pki / "ca.crt", pki / "admin.crt", pki / "admin.key"),
        timeout=5,
    )
    healthy = True
    try:
        ready = api.get_text("/readyz")
        node = api.get(f"/api/v1/nodes/{info['node']}")
        node_ready = any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in node.get("status", {}).get("conditions") or []
        )
        pods = api.get("/api/v1/pods", fieldSelector=f"spec.nodeName={info['node']}")
    except Exception as exc:
        print(f"daemon pid {pid}, but the API server does not answer: {exc}")
        return 1
    finally:
        api.close()
    phases: dict[str, int] = {}
    for p in pods.get("items") or []:
        ph = p.get("status", {}).get("phase", "Unknown")
        phases[ph] = phases.get(ph, 0) + 1
    healthy = ready == "ok" and node_ready
    _print_ready(info)
    print(f"apiserver /readyz: {ready}; node Ready: {node_ready}; pods: {phases or 'none'}")
    return 0 if healthy else 1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="polykv-dev", description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=default_dir(), help="state directory")
    sub = p.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start the control plane and the process node")
    p_up.add_argument("--foreground", action="store_true", help="run until Ctrl-C")
    p_up.add_argument("--timeout", type=float, default=300.0)
    sub.add_parser("down", help="stop everything")
    sub.add_parser("status", help="report health")
    args = p.parse_args(argv)
    dev_dir = args.dir.resolve()
    if args.cmd == "up":
        code = up(dev_dir, args.foreground, args.timeout)
    elif args.cmd == "down":
        code = down(dev_dir)
    else:
        code = status(dev_dir)
    raise SystemExit(code)
