"""A real Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler as child processes of this one."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from . import components, pki
from .bins import ensure_binaries
from .kubeapi import ApiError, Credentials, Kube
from .lifecycle import StartStop
from .procs import ManagedProcess, ProcessLedger
from .waiting import NotReady, free_port, wait_for

log = logging.getLogger("polykv.testenv.controlplane")

# Start order; stop runs it backwards.
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


class ControlPlaneError(RuntimeError):
    pass


class ControlPlane(StartStop):
    """Owns the component processes and the files under `state_dir`:

    pki/ (certificates), etcd/ (data), logs/<component>.log, kubeconfig, and
    ports.json (what `polykv-dev status` reads).
    """

    def __init__(
        self,
        state_dir: Path,
        bin_dir: Path | None = None,
        controllers: tuple[str, ...] = components.DEFAULT_CONTROLLERS,
        verbosity: int = 1,
        ledger: ProcessLedger | None = None,
    ) -> None:
        self.ledger = ledger
        self.state_dir = state_dir.resolve()
        self.bin_dir = bin_dir
        self.controllers = controllers
        self.verbosity = verbosity
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.log_dir = self.state_dir / "logs"
        self.procs: dict[str, ManagedProcess] = {}
        self._pki: pki.Pki | None = None
        self._ports: components.Ports | None = None
        self._kube: Kube | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> None:
        """Starts every component and returns once the cluster serves requests and the
        controllers are working. On failure, stops what it started and raises with the
        log tail of the component that failed."""
        t0 = time.monotonic()
        if self.bin_dir is None:
            self.bin_dir = ensure_binaries()
        # A previous run's etcd data would resurrect its objects; start clean.
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        self.state_dir.mkdir(parents=True)
        self._pki = pki.generate(self.state_dir / "pki")
        self._ports = components.Ports(*(free_port() for _ in range(5)))
        self._write_kubeconfig()
        try:
            for name in ORDER:
                self.start_component(name, timeout_s)
            wait_for("default service account", self._default_sa, timeout_s)
        except BaseException:
            self.stop()
            raise
        (self.state_dir / "ports.json").write_text(json.dumps(self._ports.__dict__))
        log.info(
            "control plane ready in %.1fs server=%s kubeconfig=%s",
            time.monotonic() - t0,
            self.server,
            self.kubeconfig,
        )

    def stop(self) -> None:
        for name in reversed(ORDER):
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop()
        if self._kube is not None:
            self._kube.close()
            self._kube = None

    # -- single components (also for fault injection: stop or restart the apiserver) --

    def start_component(self, name: str, timeout_s: float = 120.0) -> None:
        argv = self._argv(name)
        log_path = self.log_dir / f"{name}.log"
        proc = ManagedProcess(name, argv, log_path, env=self._env(), ledger=self.ledger)
        self.procs[name] = proc
        proc.start()
        try:
            wait_for(name, lambda: self._healthy(name), timeout_s, alive=proc.alive)
        except NotReady as exc:
            raise ControlPlaneError(
                f"{exc}\n--- last lines of {proc.log_path} ---\n{proc.tail()}"
            ) from None
        log.info("component ready name=%s pid=%s", name, proc.pid)

    def stop_component(self, name: str, grace_s: float = 15.0) -> None:
        self.procs[name].stop(grace_s)

    def restart_component(self, name: str, timeout_s: float = 120.0) -> None:
        self.stop_component(name)
        self.start_component(name, timeout_s)

    # -- access ----------------------------------------------------------------------

    @property
    def ports(self) -> components.Ports:
        if self._ports is None:
            raise ControlPlaneError("control plane not started")
        return self._ports

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def credentials(self) -> Credentials:
        if self._pki is None:
            raise ControlPlaneError("control plane not started")
        return Credentials(
            self.server, self._pki.ca_cert, self._pki.admin_cert, self._pki.admin_key
        )

    @property
    def api(self) -> Kube:
        if self._kube is None:
            self._kube = Kube(self.credentials)
        return self._kube

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self._run_tool("kubectl", args, input, check, timeout_s)

    def apply(self, manifest: dict[str, Any] | str, namespace: str | None = None) -> str:
        """`kubectl apply` of one object (a dict) or YAML text; returns kubectl's output."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=text).stdout

    def helm(
        self, *args: str, check: bool = True, timeout_s: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run_tool("helm", args, None, check, timeout_s)

    def tool_env(self) -> dict[str, str]:
        """Environment for kubectl, helm, kopf and other clients of this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        # helm keeps caches and repositories in these; keep them out of $HOME.
        for var, sub in (
            ("HELM_CACHE_HOME", "helm/cache"),
            ("HELM_CONFIG_HOME", "helm/config"),
            ("HELM_DATA_HOME", "helm/data"),
        ):
            env[var] = str(self.state_dir / sub)
        if self.bin_dir is not None:
            env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    # -- internals ---------------------------------------------------------------------

    def _run_tool(
        self,
        tool: str,
        args: Sequence[str],
        input: str | None,
        check: bool,
        timeout_s: float,
    ) -> subprocess.CompletedProcess[str]:
        assert self.bin_dir is not None
        result = subprocess.run(
            [str(self.bin_dir / tool), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.tool_env(),
            timeout=timeout_s,
            check=False,
        )
        if check and result.returncode != 0:
            raise ControlPlaneError(
                f"{tool} {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result

    def _env(self) -> dict[str, str]:
        # The components must not pick up a user's KUBECONFIG or proxy settings.
        keep = ("PATH", "HOME", "LANG", "TZ", "TMPDIR")
        return {k: v for k, v in os.environ.items() if k in keep}

    def _argv(self, name: str) -> list[str]:
        assert self.bin_dir is not None and self._pki is not None
        ports, certs = self.ports, self.state_dir / "certs" / name
        if name == "etcd":
            return components.etcd(self.bin_dir, self.state_dir / "etcd", ports)
        if name == "kube-apiserver":
            return components.kube_apiserver(self.bin_dir, self._pki, ports, certs, self.verbosity)
        if name == "kube-controller-manager":
            return components.kube_controller_manager(
                self.bin_dir,
                self._pki,
                ports,
                self.kubeconfig,
                certs,
                self.controllers,
                self.verbosity,
            )
        if name == "kube-scheduler":
            return components.kube_scheduler(
                self.bin_dir, ports, self.kubeconfig, certs, self.verbosity
            )
        raise ControlPlaneError(f"unknown component {name}")

    def _healthy(self, name: str) -> bool | None:
        ports = self.ports
        if name == "etcd":
            r = httpx.get(f"http://127.0.0.1:{ports.etcd}/health", timeout=2)
            return True if r.status_code == 200 and r.json().get("health") == "true" else None
        if name == "kube-apiserver":
            return True if self.api.get_text("/readyz") == "ok" else None
        port = ports.controller_manager if name == "kube-controller-manager" else ports.scheduler
        # Their serving certificates are self-signed into --cert-dir; /healthz is open.
        r = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2)
        return True if r.status_code == 200 else None

    def _default_sa(self) -> bool | None:
        try:
            self.api.get("/api/v1/namespaces/default/serviceaccounts/default")
        except ApiError:
            return None
        return True

    def _write_kubeconfig(self) -> None:
        assert self._pki is not None
        config: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "polykv-dev",
                    "cluster": {
                        "server": self.server,
                        "certificate-authority": str(self._pki.ca_cert),
                    },
                }
            ],
            "users": [
                {
                    "name": "polykv-admin",
                    "user": {
                        "client-certificate": str(self._pki.admin_cert),
                        "client-key": str(self._pki.admin_key),
                    },
                }
            ],
            "contexts": [
                {
                    "name": "polykv-dev",
                    "context": {"cluster": "polykv-dev", "user": "polykv-admin"},
                }
            ],
            "current-context": "polykv-dev",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self.kubeconfig.chmod(0o600)
