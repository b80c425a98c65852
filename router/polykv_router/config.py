"""The router's settings, from its command line and environment (pure: both are passed in)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from polykv_api.agent_headers import (
    AGENT_HEADERS,
    FINAL_HEADERS,
    PARENT_HEADERS,
    SESSION_HEADERS,
    SessionHeaders,
    header_names,
)

API_KEY_ENV = "POLYKV_ROUTER_ENGINE_API_KEY"
ROUTER_KEY_ENV = "POLYKV_ROUTER_KEY"
SA_DIR_ENV = "POLYKV_ROUTER_SERVICEACCOUNT_DIR"
NAMESPACE_ENV = "POD_NAMESPACE"
DEFAULT_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True, slots=True)
class StaticReplica:
    name: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Config:
    host: str = "0.0.0.0"
    port: int = 8080
    selector: str | None = None
    """Label selector of the engine pods (discovery mode)."""
    namespace: str | None = None
    """Where the engine pods are; default: POD_NAMESPACE, else the service account's."""
    engine_port: int = 8080
    """The engine port when a pod declares no container port named http."""
    static: tuple[StaticReplica, ...] = ()
    """Fixed replicas instead of discovery (benchmarks, local use): always serving."""
    poll_interval_s: float = 0.5
    pool_idle_s: float = 300.0
    session_ttl_s: float = 3600.0
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    lookup_timeout_s: float = 1.0
    reservation_max_age_s: float = 10.0
    max_body_bytes: int = 32 * 1024 * 1024
    shutdown_timeout_s: float = 25.0
    engine_api_key: str | None = None
    router_key: str | None = None
    """Sent as x-polykv-router-key on every proxied request: the router's identity."""
    max_sessions: int = 100_000
    """Bindings held at most (least recently used dropped first; the engines still know)."""
    max_polled_pools: int = 256
    """Pools whose capacity is polled at most (the least recently requested is dropped)."""
    key_cache_size: int = 4096
    key_ttl_s: float = 60.0
    """How long an engine's acceptance of a client key is trusted before it is asked again."""
    key_refused_ttl_s: float = 5.0
    serviceaccount_dir: Path = Path(DEFAULT_SA_DIR)
    log_format: str = "text"
    verbose: bool = False
    session_headers: SessionHeaders = field(default_factory=SessionHeaders)
    """Which headers say who an agent is: the engine's lists (polykv_api.agent_headers)."""

    @property
    def capacity_max_age_s(self) -> float:
        """Capacity answers older than this are treated as unknown (three missed polls)."""
        return max(1.0, 3 * self.poll_interval_s)


def _replica(text: str) -> StaticReplica:
    name, sep, addr = text.partition("=")
    host, colon, port = addr.rpartition(":")
    if not (sep and name and colon and host and port.isdigit()):
        raise argparse.ArgumentTypeError(f"expected NAME=HOST:PORT, got {text!r}")
    return StaticReplica(name, host, int(port))


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _header_list(text: str) -> tuple[str, ...]:
    try:
        return header_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="polykv-router",
        description="Session-affine, capacity-aware router in front of polykv-engine replicas",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--selector", help="label selector of the engine pods (discovery)")
    p.add_argument("--namespace", help="namespace of the engine pods")
    p.add_argument("--engine-port", type=int, default=8080)
    p.add_argument(
        "--replica",
        action="append",
        type=_replica,
        default=[],
        metavar="NAME=HOST:PORT",
        help="a fixed replica instead of discovery (repeat for more)",
    )
    p.add_argument("--poll-interval-ms", type=_positive(int), default=500)
    p.add_argument("--pool-idle-s", type=_positive(float), default=300.0)
    p.add_argument("--session-ttl-s", type=_positive(float), default=3600.0)
    p.add_argument("--max-attempts", type=_positive(int), default=3)
    p.add_argument("--connect-timeout-ms", type=_positive(int), default=2000)
    p.add_argument("--lookup-timeout-ms", type=_positive(int), default=1000)
    p.add_argument("--max-body-bytes", type=_positive(int), default=32 * 1024 * 1024)
    p.add_argument("--max-sessions", type=_positive(int), default=100_000)
    p.add_argument("--max-polled-pools", type=_positive(int), default=256)
    p.add_argument("--key-cache-size", type=_positive(int), default=4096)
    p.add_argument("--key-ttl-s", type=_positive(float), default=60.0)
    p.add_argument("--key-refused-ttl-s", type=_positive(float), default=5.0)
    for kind, defaults in (
        ("session", SESSION_HEADERS),
        ("agent", AGENT_HEADERS),
        ("parent", PARENT_HEADERS),
        ("final", FINAL_HEADERS),
    ):
        p.add_argument(
            f"--{kind}-headers",
            type=_header_list,
            default=",".join(defaults),  # argparse parses a string default with ``type``
            help=f"comma-separated {kind} headers, as the engine's --polykv-{kind}-headers",
        )
    p.add_argument(
        "--router-key",
        help=f"the router's identity to the engines (default: ${ROUTER_KEY_ENV})",
    )
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def parse(argv: Sequence[str], env: Mapping[str, str]) -> Config:
    p = parser()
    a = p.parse_args(list(argv))
    if not a.replica and not a.selector:
        p.error("give --selector (discover engine pods) or --replica NAME=HOST:PORT")
    if a.replica and a.selector:
        p.error("--replica and --selector exclude each other")
    names = [r.name for r in a.replica]
    if len(set(names)) != len(names):
        p.error("replica names must be unique")
    return Config(
        host=a.host,
        port=a.port,
        selector=a.selector,
        namespace=a.namespace or env.get(NAMESPACE_ENV) or None,
        engine_port=a.engine_port,
        static=tuple(a.replica),
        poll_interval_s=a.poll_interval_ms / 1e3,
        pool_idle_s=a.pool_idle_s,
        session_ttl_s=a.session_ttl_s,
        max_attempts=a.max_attempts,
        connect_timeout_s=a.connect_timeout_ms / 1e3,
        lookup_timeout_s=a.lookup_timeout_ms / 1e3,
        max_body_bytes=a.max_body_bytes,
        engine_api_key=env.get(API_KEY_ENV) or None,
        router_key=a.router_key or env.get(ROUTER_KEY_ENV) or None,
        max_sessions=a.max_sessions,
        max_polled_pools=a.max_polled_pools,
        key_cache_size=a.key_cache_size,
        key_ttl_s=a.key_ttl_s,
        key_refused_ttl_s=a.key_refused_ttl_s,
        serviceaccount_dir=Path(env.get(SA_DIR_ENV) or DEFAULT_SA_DIR),
        log_format=a.log_format,
        verbose=a.verbose,
        session_headers=SessionHeaders(
            a.session_headers, a.agent_headers, a.parent_headers, a.final_headers
        ),
    )
