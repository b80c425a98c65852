"""The process node: a Node object with a heartbeat Lease, and a PodRunner per pod that
the scheduler binds to it."""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import threading
from pathlib import Path

from ..kubeapi import MERGE_PATCH, ApiError, Credentials, Gone, Kube, Obj
from ..lifecycle import StartStop
from ..procs import ProcessLedger
from ..waiting import wait_for
from .addresses import AddressPool
from .container import now_iso
from .images import ImageTable
from .pod import NodeContext, PodRunner

log = logging.getLogger("polykv.testenv.node")

LEASE_DURATION_S = 40
LEASE_RENEW_S = 10.0  # the kubelet's default: a quarter of the lease duration
STATUS_REPORT_S = 60.0

# Generous on purpose: pods are processes on this machine, and requests sized for a
# real cluster should still schedule here.
DEFAULT_CAPACITY = {"cpu": "32", "memory": "128Gi", "pods": "110", "ephemeral-storage": "100Gi"}


def micro_now() -> str:
    # Lease times are MicroTime: RFC 3339 with exactly six fractional digits.
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ProcessNode(StartStop):
    """Usable in-process (tests) or inside the `polykv-dev` daemon. start() returns once
    the Node reports Ready; stop() kills every pod process it started."""

    def __init__(
        self,
        creds: Credentials,
        state_dir: Path,
        name: str = "polykv-node",
        host_ip: str = "127.0.0.1",
        ip_prefix: str = "127.0.0",
        images: ImageTable | None = None,
        capacity: dict[str, str] | None = None,
        ledger: ProcessLedger | None = None,
    ) -> None:
        self.name = name
        self.host_ip = host_ip
        self.state_dir = state_dir.resolve()
        self.api = Kube(creds)
        # The watch gets a client of its own: stop() closes it to end a blocked read.
        self._watch_api = Kube(creds)
        self.capacity = capacity or dict(DEFAULT_CAPACITY)
        port = int(creds.server.rsplit(":", 1)[1])
        self.ctx = NodeContext(
            api=self.api,
            node_name=name,
            host_ip=host_ip,
            addresses=AddressPool(ip_prefix),
            images=images or ImageTable.from_env(),
            pods_dir=self.state_dir / "pods",
            claims_dir=self.state_dir / "claims",
            apiserver_port=port,
            ledger=ledger,
        )
        self.runners: dict[str, PodRunner] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._done: set[str] = set()  # pods whose runner finished; late events are ignored
        self._ready_since = ""

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> None:
        self._register()
        self._renew_lease()
        for target, label in ((self._heartbeat, "heartbeat"), (self._informer, "informer")):
            t = threading.Thread(target=target, name=f"{self.name} {label}", daemon=True)
            t.start()
            self._threads.append(t)
        wait_for(f"node {self.name} Ready", self._ready, timeout_s)
        log.info("process node ready name=%s dir=%s", self.name, self.state_dir)

    def stop(self, delete_node: bool = False) -> None:
        self._stop.set()
        self._watch_api.close()
        with self._lock:
            runners = list(self.runners.values())
        for r in runners:
            r.shutdown()
        for r in runners:
            r.thread.join(10)
        for t in self._threads:
            t.join(5)
        if delete_node:
            try:
                self.api.delete(f"/api/v1/nodes/{self.name}")
            except ApiError as exc:
                log.warning("node delete failed: %s", exc)
        self.api.close()
        log.info("process node stopped name=%s pods=%d", self.name, len(runners))

    # -- lookups for tests and tools -------------------------------------------------

    def runner(self, namespace: str, name: str) -> PodRunner | None:
        with self._lock:
            for r in self.runners.values():
                if r.namespace == namespace and r.name == name and r.thread.is_alive():
                    return r
        return None

    def pid(self, namespace: str, pod: str, container: str | None = None) -> int | None:
        """The process id of a running container (the first one when not named)."""
        r = self.runner(namespace, pod)
        if r is None:
            return None
        for c in r.main:
            if container in (None, c.name) and c.running:
                return c.pid
        return None

    # -- the Node object and its Lease ---------------------------------------------

    def _register(self) -> None:
        node: Obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "polykv.io/process-node": "true",
                },
            },
            "spec": {},
        }
        try:
            self.api.create("/api/v1/nodes", node)
        except ApiError as exc:
            if exc.status != 409:
                raise
        self._untaint()
        version = self.api.get("/version").get("gitVersion", "")
        self._report_status(version)

    def _untaint(self) -> None:
        """The NodeTaint admission plugin marks every new Node not-ready; the node-lifecycle
        controller (not run here: it expects a real kubelet) would lift it once Ready."""
        node = self.api.get(f"/api/v1/nodes/{self.name}")
        taints = node["spec"].get("taints") or []
        keep = [t for t in taints if t["key"] != "node.kubernetes.io/not-ready"]
        if keep != taints:
            patch = {"spec": {"taints": keep or None}}
            self.api.patch(f"/api/v1/nodes/{self.name}", patch)

    def _report_status(self, version: str | None = None) -> None:
        now = now_iso()
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "process node is posting ready status",
            "lastHeartbeatTime": now,
            "lastTransitionTime": self._ready_since or now,
        }
        self._ready_since = ready["lastTransitionTime"]
        pressures = [
            {
                "type": t,
                "status": "False",
                "reason": f"KubeletHas{r}",
                "message": "",
                "lastHeartbeatTime": now,
                "lastTransitionTime": self._ready_since,
            }
            for t, r in (
                ("MemoryPressure", "SufficientMemory"),
                ("DiskPressure", "NoDiskPressure"),
                ("PIDPressure", "SufficientPID"),
            )
        ]
        status: Obj = {"conditions": [*pressures, ready]}
        if version is not None:
            status |= {
                "capacity": self.capacity,
                "allocatable": self.capacity,
                "addresses": [
                    {"type": "InternalIP", "address": self.host_ip},
                    {"type": "Hostname", "address": self.name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
                "nodeInfo": {
                    "machineID": self.name,
                    "systemUUID": self.name,
                    "bootID": str(os.getpid()),
                    "kernelVersion": platform.release(),
                    "osImage": "polykv process node",
                    "containerRuntimeVersion": "process://local",
                    "kubeletVersion": version,
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            }
        self.api.patch(f"/api/v1/nodes/{self.name}/status", {"status": status})

    def _renew_lease(self) -> None:
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": micro_now(),
        }
        try:
            self.api.patch(f"{path}/{self.name}", {"spec": spec}, content_type=MERGE_PATCH)
            return
        except ApiError as exc:
            if exc.status != 404:
                raise
        node_uid = self.api.get(f"/api/v1/nodes/{self.name}")["metadata"]["uid"]
        lease: Obj = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": "kube-node-lease",
                # As the kubelet does: the lease goes when the Node goes.
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": node_uid}
                ],
            },
            "spec": spec,
        }
        self.api.create(path, lease)

    def _ready(self) -> bool | None:
        node = self.api.get(f"/api/v1/nodes/{self.name}")
        for c in node.get("status", {}).get("conditions") or []:
            if c["type"] == "Ready" and c["status"] == "True":
                return True
        return None

    def _heartbeat(self) -> None:
        since_report = 0.0
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                self._renew_lease()
                since_report += LEASE_RENEW_S
                if since_report >= STATUS_REPORT_S:
                    self._report_status()
                    since_report = 0.0
            except Exception as exc:  # the API server may be down on purpose (fault tests)
                log.warning("node heartbeat failed: %s", exc)

    # -- pods ------------------------------------------------------------------------

    def _informer(self) -> None:
        selector = f"spec.nodeName={self.name}"
        rv = ""
        while not self._stop.is_set():
            try:
                if not rv:
                    listing = self._watch_api.get("/api/v1/pods", fieldSelector=selector)
                    rv = listing["metadata"]["resourceVersion"]
                    self._sync(listing.get("items") or [])
                for event in self._watch_api.watch("/api/v1/pods", rv, fieldSelector=selector):
                    obj = event["object"]
                    rv = obj["metadata"]["resourceVersion"]
                    if event["type"] == "DELETED":
                        self._removed(obj["metadata"]["uid"])
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self._upsert(obj)
            except Gone:
                rv = ""
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("pod watch interrupted: %s", exc)
                self._stop.wait(1.0)

    def _sync(self, pods: list[Obj]) -> None:
        seen = {p["metadata"]["uid"] for p in pods}
        for p in pods:
            self._upsert(p)
        with self._lock:
            stale = [uid for uid in self.runners if uid not in seen]
        for uid in stale:
            self._removed(uid)

    def _upsert(self, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            runner = self.runners.get(uid)
            if runner is not None:
                runner.update(pod)
                return
            if uid in self._done:
                return
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp"):
                return  # finished before this node (re)started
            self._forget_finished()
            runner = PodRunner(pod, self.ctx)
            self.runners[uid] = runner
        runner.thread.start()

    def _removed(self, uid: str) -> None:
        with self._lock:
            runner = self.runners.pop(uid, None)
        if runner is not None:
            runner.removed()

    def _forget_finished(self) -> None:
        for uid, r in list(self.runners.items()):
            if r.thread.ident and not r.thread.is_alive():
                del self.runners[uid]
                self._done.add(uid)
