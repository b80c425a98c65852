"""Strings that other programs see: the cluster, kopf, the engine container, dashboards.

Each is spelled once, here, so that modules which only need a name do not import the module
that happens to use it most (and so that changing one is a visible, reviewed act: objects
already in a cluster carry these values).
"""

from __future__ import annotations

FINALIZER = "polykv.io/finalizer"
"""The one finalizer the operator puts on its objects (kopf's, for every handler)."""

PREFIX = "kopf.polykv.io"
"""Annotation prefix under which kopf keeps handler progress and the last-handled spec."""

GATE = "polykv.io/pools-ready"
"""The pod readiness gate: True once a replica holds every declared pool and policy."""

ENGINE_LABEL = "polykv.io/engine"
"""Label on everything an engine owns; its value is the PolyKVEngine's name."""

CONTAINER = "engine"
"""Name of the engine container in the pod template (pod status is read by this name)."""

ROUTER_LABEL = "polykv.io/router"
"""Label on a router's pods; its value is the engine's name. Router pods never carry
ENGINE_LABEL: they must not be taken for engine replicas (or join the engine's Service)."""

ROUTER_CONTAINER = "router"
"""Name of the router container in its pod template."""

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
"""Pod annotation a ReplicaSet reads when it scales down: the pod with the lowest cost goes
first. The operator keeps it equal to the sessions each engine replica holds."""

FLOOR_PRESSURE = "polykv_floor_pressure"
"""An engine fleet's floor pressure, by this name in every form it is served in."""

DEMAND_RATIO = "polykv_session_demand_ratio"
"""An engine fleet's session demand ratio, by this name in every form it is served in."""


def http_url(host: str, port: int) -> str:
    """The base URL of a pod's port: an IPv6 address is bracketed (a dual-stack or IPv6-only
    cluster gives pods addresses such as fd00::5, which a URL cannot hold bare)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
