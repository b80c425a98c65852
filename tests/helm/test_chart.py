"""The chart without a cluster: `helm lint --strict`, what `helm template` renders for the
values that change its shape, and the generated files against their sources."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from polykv_operator import chartgen, crdgen
from polykv_operator.autoscale import apiservice

from .chart import CHART, ROOT, helm

Obj = dict[str, Any]

EXAMPLE_VALUES: Obj = {
    "engines": [
        {
            "name": "demo",
            "namespace": "agents",
            "spec": {"model": {"path": "/models/m.gguf"}, "replicas": 2},
        }
    ],
    "pools": [
        {
            "name": "crew",
            "namespace": "agents",
            "labels": {"tier": "interactive"},
            "spec": {"engineRef": {"name": "demo"}, "text": "You are the crew."},
        }
    ],
    "admissionPolicies": [
        {
            "name": "floor",
            "namespace": "agents",
            "spec": {"poolRefs": [{"name": "crew"}], "targetTpsPerSession": 5},
        }
    ],
}


def render(tmp: Path, values: Obj | None = None, *args: str) -> list[Obj]:
    extra: list[str] = []
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        extra = ["-f", str(path)]
    out = helm("template", "rel", str(CHART), "-n", "polykv-system", *extra, *args)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def kinds(docs: list[Obj]) -> list[str]:
    return [d["kind"] for d in docs]


def named(docs: list[Obj], kind: str) -> dict[str, Obj]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_lint_strict(tmp_path: Path) -> None:
    helm("lint", "--strict", str(CHART))
    values = tmp_path / "v.yaml"
    values.write_text(yaml.safe_dump(EXAMPLE_VALUES))
    helm("lint", "--strict", str(CHART), "-f", str(values))


def test_generated_files_match_their_sources() -> None:
    """crds/ of the chart == crds/ of the repo == the models; schema and Argo CD snippet."""
    for path, text in chartgen.files().items():
        assert path.read_text() == text, f"{path} is stale: python -m polykv_operator.chartgen"
    for name, text in crdgen.files().items():
        assert (CHART / "crds" / name).read_text() == (ROOT / "crds" / name).read_text() == text


def test_rbac_rules_are_the_plain_manifests_rules() -> None:
    chart_rules = yaml.safe_load((CHART / "files" / "operator-rules.yaml").read_text())
    docs = list(yaml.safe_load_all((ROOT / "operator" / "deploy" / "rbac.yaml").read_text()))
    role = next(d for d in docs if d and d["kind"] == "ClusterRole")
    assert chart_rules == role["rules"]
    verbs = {v for rule in chart_rules for v in rule["verbs"]}
    assert not verbs & {"*", "escalate", "bind", "impersonate", "get"}
    resources = {x for rule in chart_rules for x in rule["resources"]}
    assert not resources & {"*", "pods/exec"}


def test_default_install(tmp_path: Path) -> None:
    docs = render(tmp_path)
    assert {"Deployment", "ServiceAccount", "ClusterRole", "Secret", "NetworkPolicy"} <= set(
        kinds(docs)
    )
    # No Prometheus Operator in the cluster: no ServiceMonitor, no PrometheusRule.
    assert "ServiceMonitor" not in kinds(docs) and "PrometheusRule" not in kinds(docs)
    (dep,) = named(docs, "Deployment").values()
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "polykv/operator:0.1.0"
    assert "--all-namespaces" in c["args"]
    # Peering on: only one replica ever acts, so a rolling update is safe.
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate"} and dep["spec"]["replicas"] == 1
    assert "--peering=polykv" in c["args"]
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
    assert set(named(docs, "ClusterKopfPeering")) == {"polykv"}
    secret = named(docs, "Secret")["rel-polykv-master-key"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(secret["data"]["master-key"]) > 40


def test_every_pod_meets_the_restricted_profile(tmp_path: Path) -> None:
    docs = render(tmp_path, EXAMPLE_VALUES)
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job")]
    pods += [d["spec"] for d in docs if d["kind"] == "Pod"]
    assert len(pods) == 4  # operator, CRD upgrade job, cleanup job, helm test
    for pod in pods:
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False
            assert csc["readOnlyRootFilesystem"] is True
            assert csc["capabilities"] == {"drop": ["ALL"]}


def test_objects_from_values_with_sync_waves_pdbs_and_policies(tmp_path: Path) -> None:
    docs = render(tmp_path, EXAMPLE_VALUES)
    waves = {
        d["kind"]: int(d["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"])
        for d in docs
        if d["apiVersion"] == "polykv.io/v1alpha1"
    }
    assert waves["PolyKVEngine"] < waves["AdmissionPolicy"] < waves["PolyKVPool"]
    engine = named(docs, "PolyKVEngine")["demo"]
    assert engine["metadata"]["namespace"] == "agents"
    assert engine["spec"]["image"] == "polykv/engine:0.1.0"  # the chart's engine image
    pdb = named(docs, "PodDisruptionBudget")["demo-engine"]
    assert pdb["spec"]["selector"]["matchLabels"] == {"polykv.io/engine": "demo"}
    policies = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in docs
        if d["kind"] == "NetworkPolicy"
    }
    assert ("agents", "rel-polykv-engines") in policies
    assert ("polykv-system", "rel-polykv-default-deny") in policies
    test_pod = named(docs, "Pod")["rel-polykv-test"]
    args = test_pod["spec"]["containers"][0]["command"]
    assert "--pool=agents/crew/demo" in args and "--engine=agents/demo" in args


def test_router_image_and_its_network_policy(tmp_path: Path) -> None:
    values = json.loads(json.dumps(EXAMPLE_VALUES))
    values["engines"][0]["spec"]["router"] = {"enabled": True}
    values["engines"].append(
        {"name": "own", "spec": {"model": {"path": "/m.gguf"}, "router": {"image": "r/x:1"}}}
    )
    values["image"] = {"router": {"repository": "registry.example/polykv/router", "tag": "9"}}
    docs = render(tmp_path, values)
    engines = named(docs, "PolyKVEngine")
    assert engines["demo"]["spec"]["router"]["image"] == "registry.example/polykv/router:9"
    assert engines["own"]["spec"]["router"]["image"] == "r/x:1"  # the engine's own wins
    assert "router" not in named(render(tmp_path, EXAMPLE_VALUES), "PolyKVEngine")["demo"]["spec"]
    policies = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d
        for d in docs
        if d["kind"] == "NetworkPolicy"
    }
    routers = policies[("agents", "rel-polykv-routers")]["spec"]
    assert routers["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "polykv-router"}}
    assert routers["ingress"][0]["from"][0]["podSelector"] == {
        "matchLabels": {"polykv.io/agent": "true"}
    }
    to_engines = routers["egress"][0]["to"][0]["podSelector"]["matchLabels"]
    assert to_engines == {"app.kubernetes.io/name": "polykv-engine"}
    engines_in = policies[("agents", "rel-polykv-engines")]["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "polykv-router"}}} in (
        engines_in
    )
    values["image"] = {"router": {"repository": ""}}  # a repository is required
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(values))
    out = helm("template", "rel", str(CHART), "-f", str(tmp_path / "bad.yaml"), check=False)
    assert out.returncode != 0 and "at '/image/router/repository'" in out.stderr, out.stderr


def test_monitoring_objects_when_their_crds_exist(tmp_path: Path) -> None:
    docs = render(
        tmp_path,
        None,
        "--api-versions=monitoring.coreos.com/v1/ServiceMonitor",
        "--api-versions=monitoring.coreos.com/v1/PrometheusRule",
    )
    monitors = named(docs, "ServiceMonitor")
    assert set(monitors) == {"rel-polykv-operator", "rel-polykv-engines"}
    (rule,) = named(docs, "PrometheusRule").values()
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["spec"] == alerts
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    assert names == {
        "PolyKVPoolStalled",
        "PolyKVBelowTpsFloor",
        "PolyKVEngineRestartLoop",
        "PolyKVOrphanedPin",
    }
    dash = named(docs, "ConfigMap")["rel-polykv-dashboard"]
    panels = json.loads(dash["data"]["polykv.json"])["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 10


def test_peering_objects_follow_the_namespaces_and_standalone_stays_single(
    tmp_path: Path,
) -> None:
    docs = render(tmp_path, {"operator": {"watchNamespaces": ["a", "b"], "replicas": 2}})
    peers = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in docs
        if d["kind"] == "KopfPeering"
    }
    assert peers == {("a", "polykv"), ("b", "polykv")} and "ClusterKopfPeering" not in kinds(docs)
    (dep,) = named(docs, "Deployment").values()
    assert dep["spec"]["replicas"] == 2
    alone = {"operator": {"peering": {"enabled": False, "name": "polykv"}}}
    docs = render(tmp_path, alone)
    (dep,) = named(docs, "Deployment").values()
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(a.startswith("--peering") for a in args)
    assert "ClusterKopfPeering" not in kinds(docs)
    # Two standalone operators would both act: refused with the reason.
    (tmp_path / "two.yaml").write_text(
        yaml.safe_dump({"operator": {"replicas": 2, "peering": {"enabled": False, "name": "p"}}})
    )
    out = helm("template", "rel", str(CHART), "-f", str(tmp_path / "two.yaml"), check=False)
    assert out.returncode != 0 and "needs operator.peering.enabled" in out.stderr, out.stderr


def test_existing_secret_and_namespaced_operator(tmp_path: Path) -> None:
    values = {
        "masterKey": {"existingSecret": "mine", "secretKey": "k"},
        "operator": {"watchNamespaces": ["a", "b"]},
    }
    docs = render(tmp_path, values)
    assert "Secret" not in kinds(docs)
    (dep,) = named(docs, "Deployment").values()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POLYKV_OPERATOR_MASTER_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "mine",
        "key": "k",
    }
    assert "--namespace=a" in c["args"] and "--all-namespaces" not in c["args"]
    cleanup = named(docs, "Job")["rel-polykv-hooks-cleanup"]
    assert "--namespace=b" in cleanup["spec"]["template"]["spec"]["containers"][0]["command"]


@pytest.mark.parametrize("flag", ["cleanup.onUninstall=false", "crds.upgrade=false"])
def test_hooks_can_be_turned_off(tmp_path: Path, flag: str) -> None:
    jobs = named(render(tmp_path, None, "--set", flag), "Job")
    gone = "rel-polykv-hooks-cleanup" if flag.startswith("cleanup") else "rel-polykv-hooks-crds"
    assert gone not in jobs and len(jobs) == 1


# ------------------------------------------------------------------------- autoscaling

AUTOSCALED: Obj = {
    **EXAMPLE_VALUES,
    "autoscaling": {
        "engines": [{"name": "demo", "namespace": "agents"}, {"name": "big", "maxReplicas": 9}]
    },
}


def env_of(docs: list[Obj]) -> dict[str, Obj]:
    (dep,) = named(docs, "Deployment").values()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in c["env"]}


def test_autoscaling_is_off_by_default_but_the_json_is_served(tmp_path: Path) -> None:
    docs = render(tmp_path)
    assert not {"HorizontalPodAutoscaler", "ScaledObject", "APIService"} & set(kinds(docs))
    assert env_of(docs)["POLYKV_OPERATOR_AUTOSCALE_PORT"]["value"] == "8082"
    assert "POLYKV_OPERATOR_EXTERNAL_METRICS_PORT" not in env_of(docs)
    svc = named(docs, "Service")["rel-polykv-operator-metrics"]
    assert {"name": "autoscale", "port": 8082, "targetPort": "autoscale", "protocol": "TCP"} in (
        svc["spec"]["ports"]
    )
    off = render(tmp_path, None, "--set", "autoscaling.jsonPort=0")
    assert "POLYKV_OPERATOR_AUTOSCALE_PORT" not in env_of(off)


def test_an_hpa_per_engine_on_its_scale_subresource_with_both_metrics(tmp_path: Path) -> None:
    hpas = named(render(tmp_path, AUTOSCALED), "HorizontalPodAutoscaler")
    demo, big = hpas["demo"], hpas["big"]
    assert demo["metadata"]["namespace"] == "agents"
    assert big["metadata"]["namespace"] == "polykv-system"
    spec = demo["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "PolyKVEngine",
        "name": "demo",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 4)
    assert big["spec"]["maxReplicas"] == 9
    metrics = {m["external"]["metric"]["name"]: m["external"] for m in spec["metrics"]}
    assert set(metrics) == {"polykv_floor_pressure", "polykv_session_demand_ratio"}
    for ext in metrics.values():
        assert ext["metric"]["selector"] == {"matchLabels": {"polykv.io/engine": "demo"}}
        assert ext["target"]["type"] == "Value"
    assert metrics["polykv_floor_pressure"]["target"]["value"] == "800m"
    assert metrics["polykv_session_demand_ratio"]["target"]["value"] == "850m"
    down = spec["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] == 600 and down["policies"][0]["value"] == 1
    assert spec["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0


def test_a_keda_scaled_object_reads_the_operators_json(tmp_path: Path) -> None:
    values = {**AUTOSCALED, "autoscaling": {**AUTOSCALED["autoscaling"], "kind": "keda"}}
    docs = render(tmp_path, values)
    assert "HorizontalPodAutoscaler" not in kinds(docs)
    so = named(docs, "ScaledObject")["demo"]
    assert so["spec"]["scaleTargetRef"]["kind"] == "PolyKVEngine"
    assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    triggers = {t["metadata"]["valueLocation"]: t for t in so["spec"]["triggers"]}
    assert set(triggers) == {"floor_pressure", "session_demand_ratio"}
    for t in triggers.values():
        assert t["type"] == "metrics-api" and t["metricType"] == "Value"
        assert t["metadata"]["format"] == "json"
        assert t["metadata"]["url"] == (
            "http://rel-polykv-operator-metrics.polykv-system.svc:8082/polykv/autoscale/agents/demo"
        )
    assert triggers["floor_pressure"]["metadata"]["targetValue"] == "0.8"
    assert triggers["session_demand_ratio"]["metadata"]["targetValue"] == "0.85"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"autoscaling": {"kind": "keda", "jsonPort": 0, "engines": [{"name": "e"}]}},
            "set autoscaling.jsonPort",
        ),
        (
            {"autoscaling": {"engines": [{"name": "e", "minReplicas": 5, "maxReplicas": 2}]}},
            "minReplicas 5 above maxReplicas 2",
        ),
        ({"autoscaling": {"kind": "vpa"}}, "/autoscaling/kind"),
        ({"autoscaling": {"floorPressureTarget": 0}}, "/autoscaling/floorPressureTarget"),
        ({"autoscaling": {"engines": [{"name": "Bad_Name"}]}}, "/autoscaling/engines/0/name"),
    ],
)
def test_impossible_autoscaling_values_are_refused(
    tmp_path: Path, values: Obj, message: str
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = helm("template", "rel", str(CHART), "-f", str(path), check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_the_external_metrics_provider_objects(tmp_path: Path) -> None:
    docs = render(tmp_path, None, "--set", "autoscaling.externalMetrics.enabled=true")
    (api,) = named(docs, "APIService").values()
    # The operator serves behind exactly this APIService (its own verdict says "ours").
    assert apiservice.verdict(api, "polykv-system", "rel-polykv-operator-external-metrics").serve
    assert (
        apiservice.verdict(api, "polykv-system", "rel-polykv-operator-external-metrics").state
        == "ours"
    )
    svc = named(docs, "Service")["rel-polykv-operator-external-metrics"]
    assert svc["spec"]["ports"] == [
        {"name": "https", "port": 443, "targetPort": "external-metrics", "protocol": "TCP"}
    ]
    secret = named(docs, "Secret")["rel-polykv-operator-external-metrics-tls"]
    assert secret["data"]["ca.crt"] == api["spec"]["caBundle"]
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "rel-polykv-operator-external-metrics.polykv-system.svc" in names.get_values_for_type(
        x509.DNSName
    )  # what the aggregator checks the serving certificate for
    env = env_of(docs)
    assert env["POLYKV_OPERATOR_EXTERNAL_METRICS_SERVICE"]["value"] == (
        "polykv-system/rel-polykv-operator-external-metrics"
    )
    assert env["POLYKV_OPERATOR_EXTERNAL_METRICS_PORT"]["value"] == "6443"
    # The same permissions as the plain manifest, bound to the chart's names.
    plain = [
        d
        for d in yaml.safe_load_all(
            (ROOT / "operator" / "deploy" / "external-metrics-rbac.yaml").read_text()
        )
        if d
    ]
    assert sorted(
        json.dumps(d["rules"], sort_keys=True) for d in plain if d["kind"] == "ClusterRole"
    ) == sorted(
        json.dumps(d["rules"], sort_keys=True)
        for d in docs
        if d["kind"] == "ClusterRole" and "external-metrics" in d["metadata"]["name"]
    )
    (binding,) = named(docs, "RoleBinding").values()
    assert binding["metadata"]["namespace"] == "kube-system"
    assert binding["roleRef"]["name"] == "extension-apiserver-authentication-reader"
    ingress = named(docs, "NetworkPolicy")["rel-polykv-operator"]["spec"]["ingress"]
    assert {"port": 6443, "protocol": "TCP"} in [p for rule in ingress for p in rule["ports"]]
