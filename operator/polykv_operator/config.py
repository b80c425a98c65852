"""Operator settings from the environment (the Deployment sets them; tests shorten them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Config:
        e = dict(os.environ if env is None else env)
        key = e.get("POLYKV_OPERATOR_MASTER_KEY", "")
        key_file = e.get("POLYKV_OPERATOR_MASTER_KEY_FILE")
        if not key and key_file:
            key = Path(key_file).read_text().strip()
        port = e.get("POLYKV_OPERATOR_METRICS_PORT")
        priority = e.get("POLYKV_OPERATOR_PRIORITY")
        return cls(
            poll_interval_s=float(e.get("POLYKV_OPERATOR_POLL_INTERVAL", "5")),
            metrics_port=int(port) if port else None,
            metrics_address=e.get("POLYKV_OPERATOR_METRICS_ADDRESS") or "0.0.0.0",
            master_key=key,
            priority=int(priority) if priority else None,
            peering_lifetime_s=int(e.get("POLYKV_OPERATOR_PEERING_LIFETIME", "20")),
        )

    def require_master_key(self) -> str:
        if not self.master_key:
            raise ConfigError(
                "POLYKV_OPERATOR_MASTER_KEY (or POLYKV_OPERATOR_MASTER_KEY_FILE) is not set: "
                "the operator derives each engine's admin key from it"
            )
        return self.master_key
