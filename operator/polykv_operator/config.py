"""Operator settings from the environment (the Deployment sets them; tests shorten them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .network_policies import NETWORK_POLICY_ENV, NetworkPolicyConfig, NetworkPolicyConfigError


class ConfigError(RuntimeError):
    pass


@dataclass(frozen=True)
class Config:
    poll_interval_s: float = 5.0
    """Seconds between two polls of one replica (and between status refreshes). One poll is
    one `GET /polykv/pools`: it carries every pool's capacity and compaction pressure."""
    metrics_port: int | None = None
    """Where /metrics is served; None: not served."""
    metrics_address: str = "0.0.0.0"
    """The address /metrics listens on (the chart gives the pod IP)."""
    master_key: str = ""
    """Secret from which every engine's admin key is derived."""
    priority: int | None = None
    """Peering priority of this replica; None: drawn at random (two replicas never tie)."""
    peering_lifetime_s: int = 20
    """Seconds after its last keep-alive that a silent peer is presumed dead (failover)."""
    autoscale_port: int | None = None
    """Where the autoscaling JSON (KEDA metrics-api) is served, on `metrics_address`; None:
    not served."""
    external_metrics_port: int | None = None
    """Where the external.metrics.k8s.io API is served over HTTPS; None: not served."""
    external_metrics_cert: Path | None = None
    """Its serving certificate and key (PEM files); required with the port."""
    external_metrics_key: Path | None = None
    external_metrics_ca: Path | None = None
    """The serving certificate's CA (PEM): the operator keeps the APIService's caBundle
    equal to it. None: the caBundle is left as it is."""
    external_metrics_service: str = "polykv-system/polykv-operator-external-metrics"
    """namespace/name of the Service the APIService routes to (checked before serving)."""
    router_cluster_role: str = "polykv-router"
    """The ClusterRole each router's RoleBinding refers to (installed with the operator)."""
    network_policy: NetworkPolicyConfig | None = None
    """Who may reach engines and routers (network_policies.py); None: no policy written."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Config:
        e = dict(os.environ if env is None else env)
        key = e.get("POLYKV_OPERATOR_MASTER_KEY", "")
        key_file = e.get("POLYKV_OPERATOR_MASTER_KEY_FILE")
        if not key and key_file:
            key = Path(key_file).read_text().strip()
        port = e.get("POLYKV_OPERATOR_METRICS_PORT")
        priority = e.get("POLYKV_OPERATOR_PRIORITY")
        policy = e.get(NETWORK_POLICY_ENV)
        try:
            network_policy = NetworkPolicyConfig.parse(policy) if policy else None
        except NetworkPolicyConfigError as exc:
            raise ConfigError(str(exc)) from None
        return cls(
            poll_interval_s=float(e.get("POLYKV_OPERATOR_POLL_INTERVAL", "5")),
            metrics_port=int(port) if port else None,
            metrics_address=e.get("POLYKV_OPERATOR_METRICS_ADDRESS") or "0.0.0.0",
            master_key=key,
            priority=int(priority) if priority else None,
            peering_lifetime_s=int(e.get("POLYKV_OPERATOR_PEERING_LIFETIME", "20")),
            autoscale_port=_port(e, "POLYKV_OPERATOR_AUTOSCALE_PORT"),
            external_metrics_port=_port(e, "POLYKV_OPERATOR_EXTERNAL_METRICS_PORT"),
            external_metrics_cert=_path(e, "POLYKV_OPERATOR_EXTERNAL_METRICS_CERT"),
            external_metrics_key=_path(e, "POLYKV_OPERATOR_EXTERNAL_METRICS_KEY"),
            external_metrics_ca=_path(e, "POLYKV_OPERATOR_EXTERNAL_METRICS_CA"),
            external_metrics_service=e.get("POLYKV_OPERATOR_EXTERNAL_METRICS_SERVICE")
            or cls.external_metrics_service,
            router_cluster_role=e.get("POLYKV_OPERATOR_ROUTER_CLUSTER_ROLE")
            or cls.router_cluster_role,
            network_policy=network_policy,
        )

    def check(self) -> None:
        """Settings that cannot work together fail at start, naming the variable."""
        self.require_master_key()
        if self.external_metrics_port is not None and not (
            self.external_metrics_cert and self.external_metrics_key
        ):
            raise ConfigError(
                "POLYKV_OPERATOR_EXTERNAL_METRICS_PORT needs POLYKV_OPERATOR_EXTERNAL_METRICS_CERT"
                " and POLYKV_OPERATOR_EXTERNAL_METRICS_KEY (the serving certificate's files)"
            )
        ns, _, name = self.external_metrics_service.partition("/")
        if not ns or not name or "/" in name:
            raise ConfigError(
                "POLYKV_OPERATOR_EXTERNAL_METRICS_SERVICE must be namespace/name, not "
                f"{self.external_metrics_service!r}"
            )

    def require_master_key(self) -> str:
        if not self.master_key:
            raise ConfigError(
                "POLYKV_OPERATOR_MASTER_KEY (or POLYKV_OPERATOR_MASTER_KEY_FILE) is not set: "
                "the operator derives each engine's admin key from it"
            )
        return self.master_key


def _port(env: dict[str, str], key: str) -> int | None:
    raw = env.get(key)
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{key} must be a port number, not {raw!r}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"{key} must be a port number (1-65535), not {raw!r}")
    return port


def _path(env: dict[str, str], key: str) -> Path | None:
    raw = env.get(key)
    return Path(raw) if raw else None
