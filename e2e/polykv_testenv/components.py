"""Command lines of the control-plane components (flags only; starting them is elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .pki import FRONT_PROXY_CN, SERVICE_CIDR, Pki

# What the process node and the operator need, and nothing that expects a real kubelet,
# cloud or network: node-lifecycle would taint our node whenever a heartbeat is late, and
# the endpoint controllers reject loopback pod IPs.
DEFAULT_CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "job-controller",
    "disruption-controller",
    "horizontal-pod-autoscaler-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "pod-garbage-collector-controller",
)


@dataclass(frozen=True)
class Ports:
    etcd: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


def etcd(bin_dir: Path, data_dir: Path, ports: Ports) -> list[str]:
    client = f"http://127.0.0.1:{ports.etcd}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        str(bin_dir / "etcd"),
        "--name=polykv",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        # etcd refuses to start unless these three agree.
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=polykv={peer}",
        # Test data is disposable; fsync on every write dominates apiserver latency.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def kube_apiserver(
    bin_dir: Path, pki: Pki, ports: Ports, cert_dir: Path, verbosity: int = 1
) -> list[str]:
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.apiserver}",
        # Without it the apiserver looks for a default route, which an offline box lacks.
        "--advertise-address=127.0.0.1",
        # The "kubernetes" Service's endpoints cannot hold a loopback address.
        "--endpoint-reconciler-type=none",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=RBAC",
        "--allow-privileged=true",
        # Pods here run as local processes without mounted tokens; the plugin would also make
        # pod creation in a brand-new namespace race the serviceaccount controller.
        "--disable-admission-plugins=ServiceAccount",
        f"--requestheader-client-ca-file={pki.front_proxy_ca}",
        f"--requestheader-allowed-names={FRONT_PROXY_CN}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki.front_proxy_cert}",
        f"--proxy-client-key-file={pki.front_proxy_key}",
        # With the default (0) open watches are not ended on SIGTERM, and shutdown then
        # waits up to a minute for clients to hang up: restarts in fault tests would stall.
        "--shutdown-watch-termination-grace-period=2s",
        "--profiling=false",
        f"--v={verbosity}",
    ]


def _controller_common(kubeconfig: Path, port: int, cert_dir: Path) -> list[str]:
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={cert_dir}",
        "--leader-elect=false",
        "--profiling=false",
    ]


def kube_controller_manager(
    bin_dir: Path,
    pki: Pki,
    ports: Ports,
    kubeconfig: Path,
    cert_dir: Path,
    controllers: tuple[str, ...] = DEFAULT_CONTROLLERS,
    verbosity: int = 1,
) -> list[str]:
    return [
        str(bin_dir / "kube-controller-manager"),
        *_controller_common(kubeconfig, ports.controller_manager, cert_dir),
        f"--controllers={','.join(controllers)}",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca_cert}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # Tests wait on HPA decisions; the default 15 s period makes them slow.
        "--horizontal-pod-autoscaler-sync-period=5s",
        "--kube-api-qps=100",
        "--kube-api-burst=200",
        f"--v={verbosity}",
    ]


def kube_scheduler(
    bin_dir: Path, ports: Ports, kubeconfig: Path, cert_dir: Path, verbosity: int = 1
) -> list[str]:
    return [
        str(bin_dir / "kube-scheduler"),
        *_controller_common(kubeconfig, ports.scheduler, cert_dir),
        f"--v={verbosity}",
    ]
