"""One pod on the process node: its containers, its status writes and its deletion.

Each PodRunner owns a thread. The node's informer hands it the latest pod object; the
thread alone starts and stops processes and writes the pod's status.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kubeapi import STRATEGIC_PATCH, ApiError, Kube, Obj, pod_path
from ..procs import ProcessLedger
from . import images as img
from . import serviceaccount
from .addresses import AddressPool
from .container import ContainerRunner, Launch, base_environment, now_iso
from .podenv import ConfigError, SourceReader, container_env, expand
from .status import pod_status
from .volumes import PathRewriter, mount_map, prepare

log = logging.getLogger("polykv.testenv.node.pod")

TICK_S = 0.2


@dataclass(frozen=True)
class NodeContext:
    """What a pod needs from its node."""

    api: Kube
    node_name: str
    host_ip: str
    addresses: AddressPool
    images: img.ImageTable
    pods_dir: Path
    claims_dir: Path
    apiserver_port: int
    ledger: ProcessLedger | None = None  # where container processes are recorded, if anywhere


class PodRunner:
    def __init__(self, pod: Obj, ctx: NodeContext) -> None:
        self.ctx = ctx
        meta = pod["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.key = f"{self.namespace}/{self.name}"
        self.dir = ctx.pods_dir / f"{self.namespace}_{self.name}_{self.uid}"
        self._pod = pod
        self._gone = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._shutdown = threading.Event()
        self.pod_ip = ""
        self.start_time = now_iso()
        self._volumes: dict[str, Path] | None = None
        self._kubeconfig: tuple[Path | None] | None = None  # None: not looked at yet
        self._last_status = ""
        # Our last written conditions: the informer's copy may lag behind them.
        self._sent: dict[str, Obj] = {}
        spec = pod["spec"]
        policy = spec.get("restartPolicy", "Always")
        self.grace_s = float(spec.get("terminationGracePeriodSeconds", 30))
        # Init containers run to completion, so "Always" means "OnFailure" for them.
        init_policy = "OnFailure" if policy == "Always" else policy
        self.init = [self._runner(c, init_policy) for c in spec.get("initContainers") or []]
        self.main = [self._runner(c, policy) for c in spec.get("containers") or []]
        if self.init:
            for c in self.main:
                c.waiting = ("PodInitializing", "")
        self.thread = threading.Thread(target=self._run, name=f"pod {self.key}", daemon=True)

    # -- called from the informer thread --------------------------------------------

    def update(self, pod: Obj) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def removed(self) -> None:
        """The pod object is gone from the API (force deletion): kill without grace."""
        with self._lock:
            self._gone = True
        self._wake.set()

    def shutdown(self) -> None:
        """The node is stopping: kill the processes, leave the API object alone."""
        self._shutdown.set()
        self._wake.set()

    # -- the pod's own thread --------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("pod runner crashed pod=%s", self.key)
        finally:
            for c in [*self.init, *self.main]:
                c.kill_now()
            if self.pod_ip:
                self.ctx.addresses.release(self.pod_ip)

    def _loop(self) -> None:
        ports = [int(p["containerPort"]) for c in self.main for p in c.spec.get("ports") or []]
        self.pod_ip = self.ctx.addresses.allocate(ports)
        log.info("pod admitted pod=%s ip=%s", self.key, self.pod_ip)
        deleting_since: float | None = None
        while not self._shutdown.is_set():
            with self._lock:
                pod, gone = self._pod, self._gone
            now = time.monotonic()
            if gone:
                log.info("pod removed from the API; killing pod=%s", self.key)
                return
            if pod["metadata"].get("deletionTimestamp") and deleting_since is None:
                deleting_since = now
                grace = float(pod["metadata"].get("deletionGracePeriodSeconds", self.grace_s))
                self._emit("Normal", "Killing", f"Stopping containers (grace period {grace:.0f}s)")
                for c in [*self.init, *self.main]:
                    c.stop(now, grace)
            self._tick(now)
            if deleting_since is not None and not any(c.running for c in [*self.init, *self.main]):
                self._write_status(pod)
                self._delete_object()
                return
            self._write_status(pod)
            self._wake.wait(TICK_S)
            self._wake.clear()

    def _tick(self, now: float) -> None:
        for c in self.init:
            if c.finished and c.succeeded:
                continue
            c.tick(self.pod_ip, now)
            if not (c.finished and c.succeeded):
                return  # the next init container (and the main ones) wait for this one
        for c in self.main:
            c.tick(self.pod_ip, now)

    def _write_status(self, pod: Obj) -> None:
        status = pod_status(
            pod, self.init, self.main, self.pod_ip, self.ctx.host_ip, self.start_time, self._sent
        )
        encoded = json.dumps(status, sort_keys=True)
        if encoded == self._last_status:
            return
        # The uid makes the patch fail instead of landing on a same-named successor.
        body = {"metadata": {"uid": self.uid}, "status": status}
        try:
            self.ctx.api.patch(
                pod_path(self.namespace, self.name, "status"), body, content_type=STRATEGIC_PATCH
            )
        except ApiError as exc:
            if exc.status in (404, 409):
                self.removed()
                return
            log.warning("status write failed pod=%s: %s", self.key, exc)
            return
        self._last_status = encoded
        self._sent = {c["type"]: c for c in status["conditions"]}
        log.debug("status pod=%s phase=%s", self.key, status["phase"])

    def _delete_object(self) -> None:
        # What the kubelet does once the containers are gone: finish the graceful delete.
        options = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        try:
            self.ctx.api.delete(pod_path(self.namespace, self.name), options)
        except ApiError as exc:
            if exc.status not in (404, 409):
                log.warning("final delete failed pod=%s: %s", self.key, exc)
        log.info("pod deleted pod=%s", self.key)

    # -- containers ------------------------------------------------------------------

    def _runner(self, container: Obj, policy: str) -> ContainerRunner:
        return ContainerRunner(
            container,
            policy,
            lambda: self._launch(container),
            self.dir / "logs" / container["name"],
            lambda kind, reason, msg: self._emit(kind, reason, msg, container["name"]),
            grace_s=self.grace_s,
            ledger=self.ctx.ledger,
        )

    def _launch(self, container: Obj) -> Launch:
        with self._lock:
            pod = self._pod
        reader = SourceReader(self.ctx.api, self.namespace)
        if self._volumes is None:
            self._volumes = prepare(pod, self.dir, self.ctx.claims_dir, reader)
        entry = self.ctx.images.lookup(container["image"])
        base = {
            **base_environment(),
            **entry.env,
            "HOSTNAME": self.name,
            # Where an in-cluster client would look for the API server.
            "KUBERNETES_SERVICE_HOST": self.ctx.host_ip,
            "KUBERNETES_SERVICE_PORT": str(self.ctx.apiserver_port),
        }
        kubeconfig = self._service_account(pod)
        if kubeconfig is not None:
            base["KUBECONFIG"] = str(kubeconfig)
        env = container_env(container, pod, base, reader, self.pod_ip, self.ctx.host_ip)
        rewrite = PathRewriter(mount_map(container, self._volumes))
        own = {v["name"] for v in container.get("env") or []}
        env = {k: rewrite(v) if k in own else v for k, v in env.items()}
        command = [expand(a, env) for a in container.get("command") or []]
        args = [expand(a, env) for a in container.get("args") or []]
        argv = [rewrite(a) for a in img.container_argv(entry, command, args)]
        if entry.bind_flag and not command:
            # The flag belongs to the image's own entrypoint; a `command` runs another program
            # (an init container running a tool from the same image, say).
            argv = img.force_bind(argv, entry.bind_flag, self.pod_ip)
        argv[0] = img.resolve_executable(argv[0])
        workdir = container.get("workingDir")
        cwd = Path(rewrite(workdir)) if workdir else self.dir
        cwd.mkdir(parents=True, exist_ok=True)
        return Launch(argv=argv, env=env, cwd=cwd, image_id=f"local://{argv[0]}")

    def _service_account(self, pod: Obj) -> Path | None:
        """The pod's ServiceAccount credentials as a kubeconfig (what the kubelet's token
        mount gives a real container), or None when the pod opts out."""
        if self._kubeconfig is None:
            try:
                wanted = serviceaccount.automount(self.ctx.api, pod)
                path = (
                    serviceaccount.write_kubeconfig(self.ctx.api, pod, self.dir / "serviceaccount")
                    if wanted
                    else None
                )
            except ApiError as exc:  # retried like a kubelet: the container stays Waiting
                raise ConfigError(f"service account token: {exc.message}") from None
            self._kubeconfig = (path,)
        return self._kubeconfig[0]

    def _emit(self, kind: str, reason: str, message: str, container: str = "") -> None:
        now = now_iso()
        involved: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
        }
        if container:
            involved["fieldPath"] = f"spec.containers{{{container}}}"
        event = {
            "metadata": {"generateName": f"{self.name}.", "namespace": self.namespace},
            "involvedObject": involved,
            "type": kind,
            "reason": reason,
            "message": message,
            "source": {"component": "kubelet", "host": self.ctx.node_name},
            "reportingComponent": "kubelet",
            "reportingInstance": self.ctx.node_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.ctx.api.create(f"/api/v1/namespaces/{self.namespace}/events", event)
        except ApiError as exc:  # a terminating namespace refuses events; not our problem
            log.debug("event not recorded pod=%s: %s", self.key, exc)
