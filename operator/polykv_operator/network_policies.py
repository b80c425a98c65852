"""The NetworkPolicies an engine owns, as pure builders: one for its pods, one for its
router's. The operator writes them with the engine's other objects, in whatever namespace
the engine is, so every namespace it serves is covered (a chart can only write policies in
namespaces it knows of when it is installed).

Who may reach whom is the installer's choice (the chart's networkPolicy values, passed as
JSON in POLYKV_OPERATOR_NETWORK_POLICY); what is fixed here: an engine pod is reached on
its port only, by those peers and its own router; it reaches what `engineEgress` allows
(DNS by default), plus `modelEgress` while it has a model init container that downloads; a
router is reached on its port by `routerIngress` and reaches its own engine and what
`routerEgress` allows (the API server, DNS). Without the variable, no policy is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .api import PolyKVEngineSpec, RouterSpec
from .names import ENGINE_LABEL, ROUTER_LABEL

Obj = dict[str, Any]
NETWORK_POLICY_ENV = "POLYKV_OPERATOR_NETWORK_POLICY"


class NetworkPolicyConfigError(ValueError):
    pass


@dataclass(frozen=True)
class NetworkPolicyConfig:
    ingress: tuple[Obj, ...]
    """Peers that may reach an engine (agents, the operator, scrapers, the chart's tests)."""
    egress: tuple[Obj, ...]
    """Egress rules of every engine pod."""
    model_egress: tuple[Obj, ...]
    """Egress rules added to the pods of an engine with a model init container."""
    router_ingress: tuple[Obj, ...]
    """Peers that may reach a router (agents, scrapers)."""
    router_egress: tuple[Obj, ...]
    """Egress rules of a router besides its engine (the API server, DNS)."""

    @classmethod
    def parse(cls, raw: str) -> NetworkPolicyConfig:
        """From the JSON the chart writes; a wrong shape names the key."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise NetworkPolicyConfigError(f"{NETWORK_POLICY_ENV} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise NetworkPolicyConfigError(f"{NETWORK_POLICY_ENV} must be a JSON object")
        keys = {
            "ingress": "ingress",
            "egress": "egress",
            "modelEgress": "model_egress",
            "routerIngress": "router_ingress",
            "routerEgress": "router_egress",
        }
        unknown = set(data) - set(keys)
        if unknown:
            raise NetworkPolicyConfigError(f"{NETWORK_POLICY_ENV}: unknown keys {sorted(unknown)}")
        out: dict[str, tuple[Obj, ...]] = {}
        for key, attr in keys.items():
            items = data.get(key) or []
            if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
                raise NetworkPolicyConfigError(
                    f"{NETWORK_POLICY_ENV}: {key} must be a list of objects"
                )
            out[attr] = tuple(items)
        return cls(**out)


def _policy(name: str, labels: dict[str, str], selector: dict[str, str], spec: Obj) -> Obj:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress", "Egress"],
            **spec,
        },
    }


def engine_policy(
    name: str, spec: PolyKVEngineSpec, labels: dict[str, str], cfg: NetworkPolicyConfig
) -> Obj:
    """The engine's pods: reached on their port by the configured peers and their router."""
    egress = [*cfg.egress, *(cfg.model_egress if spec.model.init is not None else ())]
    own_router = {"podSelector": {"matchLabels": {ROUTER_LABEL: name}}}
    ingress = {
        "from": [*cfg.ingress, own_router],
        "ports": [{"port": spec.port, "protocol": "TCP"}],
    }
    return _policy(name, labels, {ENGINE_LABEL: name}, {"ingress": [ingress], "egress": egress})


def router_policy(
    name: str,
    engine: str,
    spec: PolyKVEngineSpec,
    labels: dict[str, str],
    cfg: NetworkPolicyConfig,
) -> Obj:
    """A router's pods: reached on their port by the configured peers; they reach their
    own engine's pods on the engine port, and what `routerEgress` allows."""
    router = spec.router or RouterSpec()
    port = {"port": router.port, "protocol": "TCP"}
    ingress = {"from": list(cfg.router_ingress), "ports": [port]}
    to_engine = {
        "to": [{"podSelector": {"matchLabels": {ENGINE_LABEL: engine}}}],
        "ports": [{"port": spec.port, "protocol": "TCP"}],
    }
    return _policy(
        name,
        labels,
        {ROUTER_LABEL: engine},
        {"ingress": [ingress], "egress": [to_engine, *cfg.router_egress]},
    )
