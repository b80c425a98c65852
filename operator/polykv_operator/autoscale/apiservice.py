"""The APIService that routes `external.metrics.k8s.io/v1beta1` to the operator, and the
verdict on the one a cluster already has (pure).

A cluster has one provider per group and version: KEDA and prometheus-adapter register the
same APIService name. So the operator's provider is opt-in, and it is never installed over
someone else's: the chart refuses to render it when the APIService exists without our label
(the chart's pre-install job, hooks.py `external-metrics-tls`), the plain manifest is created
rather than applied, and the operator itself serves the API only when the APIService in the
cluster is absent or points at its own Service (`verdict`). The operator never creates an
APIService, and of its own it changes the caBundle only: registering or rerouting an API
group is a privilege it does not hold.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

from .external_metrics import APISERVICE_NAME, GROUP, VERSION

MANAGED_BY = "app.kubernetes.io/managed-by"
PART_OF = "app.kubernetes.io/part-of"
OURS = "polykv"  # the part-of label value that marks the APIService as ours

Obj = dict[str, Any]


def desired(namespace: str, service: str, port: int, ca_pem: bytes | None = None) -> Obj:
    """Our APIService: the aggregator reaches `service.namespace.svc:port` over TLS and
    checks the serving certificate against `ca_pem` (None: no caBundle yet; the operator
    sets it from its serving certificate's CA, metrics_api.keep_ca_bundle)."""
    spec: Obj = {
        "group": GROUP,
        "version": VERSION,
        "service": {"namespace": namespace, "name": service, "port": port},
        "groupPriorityMinimum": 100,
        "versionPriority": 100,
    }
    if ca_pem is not None:
        spec["caBundle"] = base64.b64encode(ca_pem).decode()
    return {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": APISERVICE_NAME, "labels": {PART_OF: OURS}},
        "spec": spec,
    }


@dataclass(frozen=True)
class Verdict:
    state: Literal["absent", "ours", "foreign"]
    message: str

    @property
    def serve(self) -> bool:
        """Whether the operator serves the API (a foreign provider: no)."""
        return self.state != "foreign"


def verdict(existing: Obj | None, namespace: str, service: str) -> Verdict:
    """What the cluster's APIService (None: there is none) means for our provider."""
    if existing is None:
        return Verdict(
            "absent",
            f"no APIService {APISERVICE_NAME} yet: the API is served, and reachable once the "
            f"APIService points at Service {namespace}/{service}",
        )
    spec = existing.get("spec") or {}
    svc = spec.get("service") or {}
    labels = (existing.get("metadata") or {}).get("labels") or {}
    target = f"{svc.get('namespace')}/{svc.get('name')}" if svc else "the API server itself"
    if labels.get(PART_OF) == OURS and (svc.get("namespace"), svc.get("name")) == (
        namespace,
        service,
    ):
        return Verdict("ours", f"APIService {APISERVICE_NAME} points at {target}")
    return Verdict(
        "foreign",
        f"APIService {APISERVICE_NAME} belongs to another provider (it routes to {target}); "
        "the operator does not serve external.metrics.k8s.io next to it: use KEDA's "
        "metrics-api or prometheus trigger instead, or remove that provider first",
    )
