"""The generated parts of the Helm chart: ``python -m polykv_operator.chartgen [--check]``.

- ``helm/polykv/crds/``: the same files crdgen writes to ``crds/`` (one source: ``api/``).
- ``helm/polykv/values.schema.json``: every chart value, closed (``additionalProperties:
  false``), so a typo or a wrong type fails ``helm install`` naming the field; the specs of
  ``engines``, ``pools`` and ``admissionPolicies`` are the CRDs' own spec schemas, closed too.
- ``helm/polykv/docs/argocd-cm.yaml``: the Argo CD health checks (``files/argocd/health.lua``)
  as the ``resource.customizations.health.*`` keys of argocd-cm.
- ``operator/deploy/rbac.yaml``: the operator's RBAC and admission policy for the plain
  manifests, from the chart's rule files (the chart's cluster-wide rendering of them).

tests/helm/test_chartgen.py fails when a committed file differs from what this writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from . import crdgen
from .api import ADMISSION, ENGINE, GROUP, POOL, Kind
from .manifests import ROUTER_CLUSTER_ROLE

Schema = dict[str, Any]

CHART = Path(__file__).resolve().parents[2] / "helm" / "polykv"

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
QUANTITY = {"type": ["string", "number"]}

STR: Schema = {"type": "string"}
BOOL: Schema = {"type": "boolean"}


def closed(properties: dict[str, Schema], required: tuple[str, ...] = (), **extra: Any) -> Schema:
    out: Schema = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        out["required"] = list(required)
    return {**out, **extra}


def string_map(description: str) -> Schema:
    return {"type": "object", "description": description, "additionalProperties": STR}


def free(description: str, kind: str = "object") -> Schema:
    """A Kubernetes structure passed through as written (affinity, tolerations...)."""
    return {"type": kind, "description": description}


def integer(lo: int, hi: int | None = None, description: str = "") -> Schema:
    out: Schema = {"type": "integer", "minimum": lo}
    if hi is not None:
        out["maximum"] = hi
    if description:
        out["description"] = description
    return out


def selector(description: str) -> Schema:
    return closed(
        {
            "matchLabels": string_map("labels the object must carry"),
            "matchExpressions": free("set-based requirements", "array"),
        },
        description=description,
    )


def strict(node: Any) -> Any:
    """A CRD schema node, closed wherever it lists properties and keeps nothing unknown
    (the API server would prune an unknown field silently; the chart refuses it). OpenAPI
    v3's boolean exclusive bounds become draft-07's numeric ones."""
    if isinstance(node, dict):
        out = {k: strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if out.get(bound) is True and limit in out:
                out[bound] = out.pop(limit)
            elif out.get(bound) is False:
                del out[bound]
        return out
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


def objects(kind: Kind, drop_required: tuple[str, ...] = ()) -> Schema:
    spec = strict(crdgen.model_schema(kind.spec, keep_defaults=False))
    if drop_required:
        spec["required"] = [r for r in spec.get("required", []) if r not in drop_required]
    item = closed(
        {
            "name": {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253},
            "namespace": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
            "labels": string_map("extra labels"),
            "annotations": string_map("extra annotations"),
            "spec": spec,
        },
        ("name", "spec"),
    )
    return {
        "type": "array",
        "description": f"{kind.kind} objects ({GROUP}) created with the release.",
        "items": item,
    }


def image(with_pull_policy: bool) -> Schema:
    props: dict[str, Schema] = {
        "repository": {"type": "string", "minLength": 1},
        "tag": {"type": "string", "description": "empty: the chart's appVersion"},
    }
    if with_pull_policy:
        props["pullPolicy"] = {"enum": ["Always", "IfNotPresent", "Never"]}
    return closed(props, ("repository",))


def autoscaling_schema() -> Schema:
    port = integer(1, 65535)
    target = {"type": "number", "exclusiveMinimum": 0, "maximum": 100}
    replicas = integer(1, 1000)
    policy = closed(
        {
            "type": {"enum": ["Pods", "Percent"]},
            "value": integer(1),
            "periodSeconds": integer(1, 1800),
        },
        ("type", "value", "periodSeconds"),
    )
    rules = closed(
        {
            "stabilizationWindowSeconds": integer(0, 3600),
            "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
            "policies": {"type": "array", "minItems": 1, "items": policy},
        }
    )
    engine = closed(
        {
            "name": {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253},
            "namespace": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
            "minReplicas": replicas,
            "maxReplicas": replicas,
        },
        ("name",),
    )
    return closed(
        {
            "jsonPort": integer(0, 65535, "0: the autoscaling JSON is not served"),
            "externalMetrics": closed(
                {
                    "enabled": BOOL,
                    "port": port,
                    "hpaServiceAccount": closed(
                        {
                            "namespace": {"type": "string", "pattern": DNS_LABEL},
                            "name": {"type": "string", "pattern": DNS_SUBDOMAIN},
                        },
                        ("namespace", "name"),
                    ),
                }
            ),
            "engines": {
                "type": "array",
                "description": "PolyKVEngines to scale (an HPA or a KEDA ScaledObject each)",
                "items": engine,
            },
            "kind": {"enum": ["hpa", "keda"]},
            "minReplicas": replicas,
            "maxReplicas": replicas,
            "floorPressureTarget": target,
            "demandRatioTarget": target,
            "behavior": closed({"scaleUp": rules, "scaleDown": rules}),
            "keda": closed({"pollingInterval": integer(1, 3600)}),
        }
    )


def values_schema() -> Schema:
    port = integer(1, 65535)
    peer = closed(
        {
            "namespaceSelector": {
                **selector("namespaces of the peers; absent: the policy's own namespace"),
                "minProperties": 1,
            },
            "podSelector": {**selector("the peer pods"), "minProperties": 1},
        },
        ("podSelector",),
    )
    labels_only = closed(
        {"enabled": BOOL, "labels": string_map("labels for the Prometheus Operator")}
    )
    schema = closed(
        {
            "image": closed(
                {"operator": image(True), "engine": image(False), "router": image(False)},
                ("operator", "engine", "router"),
            ),
            "imagePullSecrets": {
                "type": "array",
                "items": closed({"name": {"type": "string", "minLength": 1}}, ("name",)),
            },
            "operator": closed(
                {
                    "replicas": integer(
                        0, 5, "more than one needs peering (only one replica ever acts)"
                    ),
                    "peering": closed(
                        {
                            "enabled": BOOL,
                            "name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
                        },
                        ("enabled", "name"),
                    ),
                    "watchNamespaces": {
                        "type": "array",
                        "uniqueItems": True,
                        "items": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
                    },
                    "pollIntervalSeconds": {"type": "number", "exclusiveMinimum": 0},
                    "logFormat": {"enum": ["json", "plain", "full"]},
                    "verbose": BOOL,
                    "metricsPort": port,
                    "healthPort": port,
                    "resources": closed(
                        {
                            "requests": {"type": "object", "additionalProperties": QUANTITY},
                            "limits": {"type": "object", "additionalProperties": QUANTITY},
                        }
                    ),
                    "podLabels": string_map("extra labels of the operator pod"),
                    "podAnnotations": string_map("extra annotations of the operator pod"),
                    "nodeSelector": string_map("node labels"),
                    "tolerations": free("as in a Pod spec", "array"),
                    "affinity": free("as in a Pod spec"),
                    "priorityClassName": STR,
                    "extraEnv": free("more env entries for the operator container", "array"),
                }
            ),
            "masterKey": closed(
                {
                    "existingSecret": {
                        "type": "string",
                        "description": "a Secret of yours; empty: the chart generates one",
                    },
                    "secretKey": {"type": "string", "minLength": 1},
                }
            ),
            "serviceAccount": closed(
                {"create": BOOL, "name": STR, "annotations": string_map("annotations")}
            ),
            "rbac": closed({"create": BOOL, "admissionPolicy": BOOL}),
            "crds": closed({"upgrade": BOOL}),
            "cleanup": closed(
                {"onUninstall": BOOL, "timeoutSeconds": integer(10, 3600)},
            ),
            "podSecurity": closed(
                {"runAsUser": integer(1), "runAsGroup": integer(1)},
                description="restricted Pod Security: never root (uid/gid 0 is refused)",
            ),
            "networkPolicy": closed(
                {
                    "enabled": BOOL,
                    "agents": peer,
                    "scrapers": peer,
                    "autoscalers": peer,
                    "apiServer": closed(
                        {
                            "cidrs": {
                                "type": "array",
                                "description": "the API server's addresses; empty: read "
                                "from the cluster at install",
                                "items": {
                                    "type": "string",
                                    "pattern": r"^[0-9a-fA-F:.]+/[0-9]{1,3}$",
                                },
                            },
                            "ports": {"type": "array", "minItems": 1, "items": port},
                        }
                    ),
                    "engineEgress": free("NetworkPolicy egress rules of the engines", "array"),
                    "modelEgress": free(
                        "egress rules added for engines with a model init container", "array"
                    ),
                }
            ),
            "podDisruptionBudget": closed(
                {"enabled": BOOL, "maxUnavailable": {"type": ["integer", "string"]}}
            ),
            "metrics": closed(
                {
                    "serviceMonitor": closed(
                        {
                            **labels_only["properties"],
                            "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
                        }
                    ),
                    "prometheusRule": labels_only,
                }
            ),
            "grafana": closed(
                {
                    "dashboard": closed(
                        {
                            "enabled": BOOL,
                            "labels": string_map("labels Grafana's sidecar selects"),
                            "annotations": string_map("annotations (a folder, say)"),
                        }
                    )
                }
            ),
            "syncWaves": closed(
                {
                    "engines": {"type": "integer"},
                    "admissionPolicies": {"type": "integer"},
                    "pools": {"type": "integer"},
                }
            ),
            "autoscaling": autoscaling_schema(),
            "engines": objects(ENGINE),
            "pools": objects(POOL),
            "admissionPolicies": objects(ADMISSION),
            "tests": closed({"enabled": BOOL, "timeoutSeconds": integer(10, 3600)}),
        }
    )
    schema["$schema"] = "https://json-schema.org/draft-07/schema#"
    schema["title"] = "polykv chart values"
    return schema


def argocd_snippet(chart: Path = CHART) -> str:
    """argocd-cm data keys for the three kinds: the one script, files/argocd/health.lua."""
    lua = (chart / "files" / "argocd" / "health.lua").read_text()
    data = {
        f"resource.customizations.health.{GROUP}_{k.kind}": lua for k in (ENGINE, POOL, ADMISSION)
    }
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "argocd-cm",
            "namespace": "argocd",
            "labels": {"app.kubernetes.io/part-of": "argocd"},
        },
        "data": data,
    }

    class Literal(yaml.SafeDumper):
        pass

    def block(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
        style = "|" if "\n" in text else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)

    Literal.add_representer(str, block)
    header = (
        "# Generated by `python -m polykv_operator.chartgen` from files/argocd/health.lua.\n"
        "# Argo CD health checks for the PolyKV kinds: merge these keys into argocd-cm\n"
        "# (kubectl -n argocd patch configmap argocd-cm --patch-file argocd-cm.yaml).\n"
    )
    return header + yaml.dump(cm, Dumper=Literal, sort_keys=False, width=100)


PEERING_SOURCE = Path(__file__).resolve().parents[1] / "deploy" / "peering.yaml"


def peering_crds(source: Path = PEERING_SOURCE) -> dict[str, str]:
    """kopf's peering CRDs for the chart's crds/ (one file each, as the upgrade hook reads
    them), taken from the plain manifests' copy."""
    docs = [d for d in yaml.safe_load_all(source.read_text()) if d]
    head = (
        "# Generated by python -m polykv_operator.chartgen from operator/deploy/peering.yaml:\n"
        "# kopf's peering kinds (operator replicas exchange keep-alives; one acts).\n"
    )
    return {
        f"{d['metadata']['name']}.yaml": head + yaml.safe_dump(d, sort_keys=False)
        for d in docs
        if d["kind"] == "CustomResourceDefinition"
    }


PLAIN_RBAC = Path(__file__).resolve().parents[1] / "deploy" / "rbac.yaml"
PLAIN_NS, PLAIN_SA = "polykv-system", "polykv-operator"


def _rules(chart: Path, name: str) -> list[Schema]:
    rules: list[Schema] = yaml.safe_load((chart / "files" / name).read_text())
    return rules


def admission_policy(
    chart: Path, name: str, namespace: str, account: str, router_role: str
) -> list[Schema]:
    """The ValidatingAdmissionPolicy and its binding, as templates/rbac.yaml renders them."""
    rules = [
        {
            "apiGroups": [group],
            "apiVersions": ["v1"],
            "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": resources,
        }
        for group, resources in (
            ("", ["secrets", "services", "serviceaccounts", "pods", "pods/status"]),
            ("apps", ["deployments"]),
            ("rbac.authorization.k8s.io", ["rolebindings"]),
            ("networking.k8s.io", ["networkpolicies"]),
        )
    ]
    user = f"system:serviceaccount:{namespace}:{account}"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": f"{name}-writes"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": rules},
            "matchConditions": [
                {"name": "the-operator", "expression": f"request.userInfo.username == '{user}'"}
            ],
            "variables": [{"name": "routerRole", "expression": f"'{router_role}'"}],
            "validations": _rules(chart, "operator-admission.yaml"),
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": f"{name}-writes"},
        "spec": {"policyName": f"{name}-writes", "validationActions": ["Deny"]},
    }
    return [policy, binding]


def plain_rbac(chart: Path = CHART) -> str:
    """operator/deploy/rbac.yaml: the chart's RBAC for an operator serving every namespace,
    from the same rule files (helm/polykv/files/*rules.yaml, operator-admission.yaml)."""
    ns, sa = PLAIN_NS, PLAIN_SA
    router = ROUTER_CLUSTER_ROLE  # the operator's default (POLYKV_OPERATOR_ROUTER_CLUSTER_ROLE)
    rules = [
        *_rules(chart, "operator-cluster-rules.yaml"),
        *_rules(chart, "operator-all-namespaces-rules.yaml"),
        *_rules(chart, "operator-rules.yaml"),
    ]
    crb = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": sa},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": sa},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
    }
    docs = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": ns,
                "labels": {"pod-security.kubernetes.io/enforce": "restricted"},
            },
        },
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": sa},
            "rules": rules,
        },
        crb,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": router},
            "rules": _rules(chart, "router-rules.yaml"),
        },
        *admission_policy(chart, sa, ns, sa, router),
    ]
    header = (
        "# Generated by `python -m polykv_operator.chartgen` from the chart's rule files\n"
        "# (helm/polykv/files/operator-*rules.yaml, router-rules.yaml, operator-admission.yaml):\n"
        "# the PolyKV operator's least privilege when it serves every namespace, as the chart\n"
        "# renders it without operator.watchNamespaces. The namespace comes first, so that\n"
        "# `kubectl apply -f crds/ -f operator/deploy/rbac.yaml` creates it before the account.\n"
        "# Why each rule is there: the comments in those files, and the chart README.\n"
    )
    return header + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=100) for d in docs)


def plain_external_metrics_rbac(chart: Path = CHART) -> str:
    """operator/deploy/external-metrics-rbac.yaml: the permissions of the operator's own
    external metrics API, from the chart's files, bound to the plain manifests' names."""
    ns, sa = PLAIN_NS, PLAIN_SA
    name = f"{sa}-external-metrics"
    operator = [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
    reader = "polykv-external-metrics-reader"
    user = f"system:serviceaccount:{ns}:{sa}"
    docs = [
        _cluster_role(name, _rules(chart, "operator-external-metrics-rules.yaml")),
        _cluster_binding(name, name, operator),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{sa}-auth-reader", "namespace": "kube-system"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "extension-apiserver-authentication-reader",
            },
            "subjects": operator,
        },
        _cluster_role(
            reader,
            [
                {
                    "apiGroups": ["external.metrics.k8s.io"],
                    "resources": ["polykv_floor_pressure", "polykv_session_demand_ratio"],
                    "verbs": ["get", "list"],
                }
            ],
        ),
        _cluster_binding(
            reader,
            reader,
            [
                {
                    "kind": "ServiceAccount",
                    "name": "horizontal-pod-autoscaler",
                    "namespace": "kube-system",
                }
            ],
        ),
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": f"{sa}-apiservice"},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": ["apiregistration.k8s.io"],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE", "DELETE"],
                            "resources": ["apiservices"],
                        }
                    ]
                },
                "matchConditions": [
                    {"name": "the-operator", "expression": f"request.userInfo.username == '{user}'"}
                ],
                "validations": _rules(chart, "operator-apiservice-admission.yaml"),
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": f"{sa}-apiservice"},
            "spec": {"policyName": f"{sa}-apiservice", "validationActions": ["Deny"]},
        },
    ]
    header = (
        "# Generated by `python -m polykv_operator.chartgen` from the chart's files\n"
        "# (helm/polykv/files/operator-external-metrics-rules.yaml,\n"
        "# operator-apiservice-admission.yaml): the permissions of the operator's own\n"
        "# external.metrics.k8s.io API (opt-in; the chart's autoscaling.externalMetrics renders\n"
        "# the same with its Service, APIService and the job that makes the serving\n"
        "# certificate). Apply with rbac.yaml only when that API is on:\n"
        "# - the operator reads the one APIService it serves behind and sets its caBundle (the\n"
        "#   admission policy lets nothing else of it change), and reads the front-proxy CA that\n"
        "#   authenticates the aggregator (the built-in Role extension-apiserver-authentication-\n"
        "#   reader, bound in kube-system);\n"
        "# - the HPA controller may read the two metrics through the aggregator.\n"
    )
    return header + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=100) for d in docs)


def _cluster_role(name: str, rules: list[Schema]) -> Schema:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": rules,
    }


def _cluster_binding(name: str, role: str, subjects: list[Schema]) -> Schema:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": subjects,
    }


def files(chart: Path = CHART) -> dict[Path, str]:
    out = {chart / "crds" / name: text for name, text in crdgen.files().items()}
    out.update({chart / "crds" / name: text for name, text in peering_crds().items()})
    out[chart / "values.schema.json"] = json.dumps(values_schema(), indent=2) + "\n"
    out[chart / "docs" / "argocd-cm.yaml"] = argocd_snippet(chart)
    out[PLAIN_RBAC] = plain_rbac(chart)
    out[PLAIN_RBAC.parent / "external-metrics-rbac.yaml"] = plain_external_metrics_rbac(chart)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polykv_operator.chartgen", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 when a file differs")
    args = p.parse_args(argv)
    return crdgen.sync(files(), args.check, "python -m polykv_operator.chartgen")


if __name__ == "__main__":
    sys.exit(main())
