"""The chart without a cluster: `helm lint --strict`, what `helm template` renders for the
values that change its shape, and the generated files against their sources."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

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


# The operator's whole RBAC, one (apiGroup, resource, verb) a line. A new permission fails
# here until it is added on purpose. Nothing reads a Secret (no get/list/watch on them),
# creates a Role, execs, escalates, binds or impersonates.
NAMESPACED_ALLOWED = {
    *(("polykv.io", r, v) for r in ("polykvengines", "polykvpools", "admissionpolicies")
      for v in ("list", "watch", "patch")),
    ("polykv.io", "polykvpools", "delete"),
    *(("polykv.io", f"{r}/status", "patch")
      for r in ("polykvengines", "polykvpools", "admissionpolicies")),
    ("polykv.io", "polykvpools/finalizers", "update"),
    *(("apps", "deployments", v) for v in ("create", "patch", "delete", "list", "watch")),
    ("apps", "replicasets", "list"),
    ("apps", "replicasets", "watch"),
    *(("networking.k8s.io", "networkpolicies", v) for v in ("create", "patch", "delete")),
    *(("", r, v) for r in ("services", "serviceaccounts") for v in ("create", "patch", "delete")),
    *(("rbac.authorization.k8s.io", "rolebindings", v) for v in ("create", "patch", "delete")),
    ("", "secrets", "create"),
    ("", "secrets", "patch"),
    *(("", "pods", v) for v in ("list", "watch", "patch")),
    ("", "pods/status", "patch"),
    *(("kopf.dev", "kopfpeerings", v) for v in ("list", "watch", "patch")),
    ("", "events", "create"),
    ("events.k8s.io", "events", "create"),
}  # fmt: skip
CLUSTER_ALLOWED = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}
ALL_NAMESPACES_ALLOWED = {
    ("", "namespaces", "list"),
    ("", "namespaces", "watch"),
    *(("kopf.dev", "clusterkopfpeerings", v) for v in ("list", "watch", "patch")),
}
ROUTER_ALLOWED = {("", "pods", "list"), ("", "pods", "watch")}
OPERATOR = "rel-polykv-operator"


def flat(rules: list[Obj]) -> set[tuple[str, str, str]]:
    """Every (group, resource, verb) a rule list grants; a resourceNames rule would be
    narrower than it looks here, and none is used."""
    assert all("resourceNames" not in r and "nonResourceURLs" not in r for r in rules)
    return {
        (g, res, v)
        for r in rules
        for g in r["apiGroups"]
        for res in r["resources"]
        for v in r["verbs"]
    }


def test_every_operator_permission_is_on_the_allowlist(tmp_path: Path) -> None:
    docs = render(tmp_path)
    roles = named(docs, "ClusterRole")
    everything = CLUSTER_ALLOWED | ALL_NAMESPACES_ALLOWED | NAMESPACED_ALLOWED
    assert flat(roles["rel-polykv-operator"]["rules"]) == everything
    assert flat(roles["rel-polykv-operator-router"]["rules"]) == ROUTER_ALLOWED
    # Serving every namespace: one ClusterRole, no Role of the operator's.
    assert "rel-polykv-operator" not in named(docs, "Role")
    # The plain manifests are the same rules (generated from the chart's files).
    plain = [
        d for d in yaml.safe_load_all((ROOT / "operator" / "deploy" / "rbac.yaml").read_text())
    ]
    plain_roles = named([d for d in plain if d], "ClusterRole")
    assert flat(plain_roles["polykv-operator"]["rules"]) == everything
    assert flat(plain_roles["polykv-router"]["rules"]) == ROUTER_ALLOWED
    # The operator is told the router role's name.
    (dep,) = named(docs, "Deployment").values()
    env = {
        e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["POLYKV_OPERATOR_ROUTER_CLUSTER_ROLE"] == "rel-polykv-operator-router"


def test_watched_namespaces_get_roles_and_the_cluster_role_keeps_only_crd_reads(
    tmp_path: Path,
) -> None:
    docs = render(tmp_path, {"operator": {"watchNamespaces": ["a", "b"]}})
    roles = named(docs, "ClusterRole")
    assert flat(roles["rel-polykv-operator"]["rules"]) == CLUSTER_ALLOWED
    ns_roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == OPERATOR]
    assert sorted(r["metadata"]["namespace"] for r in ns_roles) == ["a", "b"]
    for role in ns_roles:
        assert flat(role["rules"]) == NAMESPACED_ALLOWED
    bindings = [
        d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": OPERATOR
        }
    ]  # fmt: skip
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["a", "b"]
    for b in bindings:
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "rel-polykv-operator", "namespace": "polykv-system"}
        ]


def test_the_admission_policy_is_bound_to_the_operators_account_only(tmp_path: Path) -> None:
    docs = render(tmp_path)
    (policy,) = named(docs, "ValidatingAdmissionPolicy").values()
    (binding,) = named(docs, "ValidatingAdmissionPolicyBinding").values()
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConditions"] == [
        {
            "name": "the-operator",
            "expression": "request.userInfo.username == "
            "'system:serviceaccount:polykv-system:rel-polykv-operator'",
        }
    ]
    assert spec["variables"] == [
        {"name": "routerRole", "expression": "'rel-polykv-operator-router'"}
    ]
    matched = {
        (g, r) for rule in spec["matchConstraints"]["resourceRules"]
        for g in rule["apiGroups"] for r in rule["resources"]
    }  # fmt: skip
    # Every kind the operator may write but its own CRs and Events goes through the policy.
    writes = {(g, r) for g, r, v in NAMESPACED_ALLOWED if v in ("create", "patch", "delete")}
    assert writes - matched == {
        ("polykv.io", "polykvengines"), ("polykv.io", "polykvpools"),
        ("polykv.io", "admissionpolicies"), ("polykv.io", "polykvengines/status"),
        ("polykv.io", "polykvpools/status"), ("polykv.io", "admissionpolicies/status"),
        ("kopf.dev", "kopfpeerings"), ("", "events"), ("events.k8s.io", "events"),
    }  # fmt: skip
    plain = [
        d for d in yaml.safe_load_all((ROOT / "operator" / "deploy" / "rbac.yaml").read_text())
    ]
    (plain_policy,) = named([d for d in plain if d], "ValidatingAdmissionPolicy").values()
    assert plain_policy["spec"]["validations"] == spec["validations"]
    off = render(tmp_path, {"rbac": {"create": True, "admissionPolicy": False}})
    assert "ValidatingAdmissionPolicy" not in kinds(off)


def test_default_install(tmp_path: Path) -> None:
    docs = render(tmp_path)
    assert {"Deployment", "ServiceAccount", "ClusterRole", "NetworkPolicy"} <= set(kinds(docs))
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
    # The master key is never rendered (helm template and Argo CD would write a new one at
    # every sync): a hook job creates it once and leaves it alone after.
    assert "Secret" not in kinds(docs)
    job = named(docs, "Job")["rel-polykv-master-key-job"]
    ann = job["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert ann["argocd.argoproj.io/hook"] == "PreSync"
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][3:] == [
        "master-key",
        "--namespace=polykv-system",
        "--secret=rel-polykv-master-key",
        "--key=master-key",
    ]
    (role,) = (
        r for r in docs if r["kind"] == "Role" and r["metadata"]["name"] == job["metadata"]["name"]
    )
    assert role["rules"][0] == {
        "apiGroups": [""],
        "resources": ["secrets"],
        "resourceNames": ["rel-polykv-master-key"],
        "verbs": ["get"],
    }
    env = {e["name"]: e for e in c["env"]}
    assert env["POLYKV_OPERATOR_MASTER_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "rel-polykv-master-key",
        "key": "master-key",
    }
    # Two renders are the same: nothing random in the chart's output.
    assert render(tmp_path) == docs


def test_every_pod_meets_the_restricted_profile(tmp_path: Path) -> None:
    docs = render(tmp_path, EXAMPLE_VALUES)
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job")]
    pods += [d["spec"] for d in docs if d["kind"] == "Pod"]
    assert len(pods) == 5  # operator, CRD upgrade, cleanup and master key jobs, helm test
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
    # The engine's own policy is the operator's to write, in its namespace, whatever that
    # is: the chart writes none outside the release namespace.
    assert policies == {
        ("polykv-system", "rel-polykv-default-deny"),
        ("polykv-system", "rel-polykv-operator"),
        ("polykv-system", "rel-polykv-hooks"),
    }
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
    values["image"] = {"router": {"repository": ""}}  # a repository is required
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(values))
    out = helm("template", "rel", str(CHART), "-f", str(tmp_path / "bad.yaml"), check=False)
    assert out.returncode != 0 and "at '/image/router/repository'" in out.stderr, out.stderr


def engine_policy_config(docs: list[Obj]) -> Obj:
    """What the operator is told to write for each engine and router."""
    env = env_of(docs)
    config: Obj = json.loads(env["POLYKV_OPERATOR_NETWORK_POLICY"]["value"])
    return config


def test_engine_network_policies_admit_by_namespace_and_label_wherever_engines_are(
    tmp_path: Path,
) -> None:
    """The operator writes each engine's and router's policy beside it, from the peers the
    chart passes; the chart itself writes none outside its namespace, so no namespace the
    operator serves (watchNamespaces or all of them) is left without one."""
    for values in (None, {"operator": {"watchNamespaces": ["a", "b"]}}):
        docs = render(tmp_path, values)
        assert {d["metadata"]["namespace"] for d in docs if d["kind"] == "NetworkPolicy"} == {
            "polykv-system"
        }
        config = engine_policy_config(docs)
        # Engines reach DNS and nothing else; a model download is closed until opened.
        assert config["egress"] == [
            {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
        ]
        assert config["modelEgress"] == []
        peers = config["ingress"] + config["routerIngress"]
        for peer in peers:
            # A pod label alone never admits: a namespace is always named, or implied (a
            # peer without namespaceSelector is the policy's own namespace: the engine's).
            assert peer.get("podSelector"), peer
            assert "namespaceSelector" not in peer or peer["namespaceSelector"], peer
        agents, operator, test_pod, scrapers = config["ingress"]
        assert agents == {"podSelector": {"matchLabels": {"polykv.io/agent": "true"}}}
        release = {"matchLabels": {"kubernetes.io/metadata.name": "polykv-system"}}
        assert operator["namespaceSelector"] == test_pod["namespaceSelector"] == release
        assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == (
            "polykv-operator"
        )
        assert scrapers["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
        }
        assert config["routerIngress"] == [agents, scrapers]
        assert config["routerEgress"][0] == {
            "to": [{"ipBlock": {"cidr": "10.96.0.1/32"}}],
            "ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}],
        }
    opened = {"networkPolicy": {"modelEgress": [{"ports": [{"port": 443}]}]}}
    assert engine_policy_config(render(tmp_path, opened))["modelEgress"] == [
        {"ports": [{"port": 443}]}
    ]
    off = render(tmp_path, {"networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in kinds(off)
    assert "POLYKV_OPERATOR_NETWORK_POLICY" not in env_of(off)
    # An empty selector (every namespace, or every pod) is refused. Helm merges a user's
    # map into the default one, so emptying a selector means nulling its matchLabels.
    for peer in ("agents", "scrapers"):
        for selector in ("namespaceSelector", "podSelector"):
            if peer == "agents" and selector == "namespaceSelector":
                continue  # no default to empty: the engine's own namespace
            emptied = {"networkPolicy": {peer: {selector: {"matchLabels": None}}}}
            (tmp_path / "open.yaml").write_text(yaml.safe_dump(emptied))
            out = helm(
                "template", "rel", str(CHART), "-f", str(tmp_path / "open.yaml"), check=False
            )
            assert out.returncode != 0 and "minProperties" in out.stderr, (peer, selector)


def test_the_api_server_is_the_only_address_the_operator_reaches_outside_the_cluster(
    tmp_path: Path,
) -> None:
    """Its egress, its jobs' and the routers' reach the API server's addresses and ports
    only. Without a cluster to read them from (helm template, Argo CD) and without the
    value, the render fails naming it: never a rule open to every address."""
    values = {"networkPolicy": {"apiServer": {"cidrs": ["192.0.2.7/32"], "ports": [6443]}}}
    docs = render(tmp_path, values)
    api = {
        "to": [{"ipBlock": {"cidr": "192.0.2.7/32"}}],
        "ports": [{"port": 6443, "protocol": "TCP"}],
    }
    policies = named(docs, "NetworkPolicy")
    for name in ("rel-polykv-operator", "rel-polykv-hooks"):
        egress = policies[name]["spec"]["egress"]
        assert api in egress
        blocks = [p["ipBlock"]["cidr"] for r in egress for p in r.get("to", []) if "ipBlock" in p]
        assert blocks == ["192.0.2.7/32"], (name, egress)
    assert engine_policy_config(docs)["routerEgress"][0] == api
    out = helm("template", "rel", str(CHART), check=False, offline=False)
    assert out.returncode != 0, out.stdout[-500:]
    assert "networkPolicy.apiServer.cidrs is empty" in out.stderr, out.stderr
    assert "each as a /32" in out.stderr


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
    assert "Secret" not in kinds(docs) and "rel-polykv-master-key-job" not in named(docs, "Job")
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


def test_each_hook_and_the_test_pod_hold_only_their_own_rules(tmp_path: Path) -> None:
    """The CRD job reads and replaces the chart's CRDs by name; the cleanup job lists and
    deletes PolyKV objects where the operator serves, the test pod reads where it checks.
    Each as an account of its own, existing only while its hook runs."""
    docs = render(tmp_path, {**EXAMPLE_VALUES, "operator": {"watchNamespaces": ["a", "b"]}})
    jobs = named(docs, "Job")
    crds_job, cleanup_job = jobs["rel-polykv-hooks-crds"], jobs["rel-polykv-hooks-cleanup"]
    accounts = {
        j["spec"]["template"]["spec"]["serviceAccountName"] for j in (crds_job, cleanup_job)
    }
    assert accounts == {"rel-polykv-hooks-crds", "rel-polykv-hooks-cleanup"}

    def bound(kind: str, account: str) -> list[Obj]:
        """The roles of `kind` bound to `account`, with where they are."""
        bindings = [
            d for d in docs
            if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
            and d["subjects"] == [
                {"kind": "ServiceAccount", "name": account, "namespace": "polykv-system"}
            ]
            and d["roleRef"]["kind"] == kind
        ]  # fmt: skip
        return [
            d for d in docs for b in bindings
            if d["kind"] == kind and d["metadata"]["name"] == b["roleRef"]["name"]
            and d["metadata"].get("namespace") == b["metadata"].get("namespace")
        ]  # fmt: skip

    (crds_role,) = bound("ClusterRole", "rel-polykv-hooks-crds")
    assert bound("Role", "rel-polykv-hooks-crds") == []
    by_name, create = crds_role["rules"]
    assert by_name["verbs"] == ["get", "update"]
    assert set(by_name["resourceNames"]) == {p.stem for p in (CHART / "crds").glob("*.yaml")}
    assert create["verbs"] == ["create"] and create["resources"] == ["customresourcedefinitions"]
    assert crds_role["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
    # Served namespaces only: Roles there, nothing cluster-wide.
    assert bound("ClusterRole", "rel-polykv-hooks-cleanup") == []
    cleanup_roles = bound("Role", "rel-polykv-hooks-cleanup")
    assert sorted(r["metadata"]["namespace"] for r in cleanup_roles) == ["a", "b"]
    for role in cleanup_roles:
        assert flat(role["rules"]) == {
            ("polykv.io", r, v)
            for r in ("polykvengines", "polykvpools", "admissionpolicies")
            for v in ("list", "delete")
        }
        assert role["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    everywhere = named(render(tmp_path), "ClusterRole")["rel-polykv-hooks-cleanup"]
    assert flat(everywhere["rules"]) == flat(cleanup_roles[0]["rules"])
    # The test pod: Roles where the release's objects and operator are.
    assert bound("ClusterRole", "rel-polykv-test") == []
    test_roles = bound("Role", "rel-polykv-test")
    assert sorted(r["metadata"]["namespace"] for r in test_roles) == ["agents", "polykv-system"]
    for role in test_roles:
        assert flat(role["rules"]) == {
            ("polykv.io", r, "get") for r in ("polykvengines", "polykvpools", "admissionpolicies")
        } | {("", "pods", "list")}


def test_every_binding_refers_to_its_own_name_so_upgrades_never_change_a_role_ref(
    tmp_path: Path,
) -> None:
    """A binding's roleRef cannot change: `helm upgrade` fails on a binding that keeps its
    name and changes its role. Each binding the chart renders (every mode, hooks and test
    included) refers to the role of its own name, and a RoleBinding to a Role (one
    exception, a built-in Role), so a new role means a new binding name."""
    full = {
        **EXAMPLE_VALUES,
        "autoscaling": {"externalMetrics": {"enabled": True}},
    }
    builtin = {("Role", "extension-apiserver-authentication-reader")}
    for values in (full, {**full, "operator": {"watchNamespaces": ["a", "b"]}}):
        for d in render(tmp_path, values):
            if d["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            ref = (d["roleRef"]["kind"], d["roleRef"]["name"])
            if ref in builtin:
                continue
            assert ref[1] == d["metadata"]["name"], d["metadata"]
            if d["kind"] == "RoleBinding":
                assert ref[0] == "Role", d["metadata"]


@pytest.mark.parametrize("flag", ["cleanup.onUninstall=false", "crds.upgrade=false"])
def test_hooks_can_be_turned_off(tmp_path: Path, flag: str) -> None:
    jobs = named(render(tmp_path, None, "--set", flag), "Job")
    gone = "rel-polykv-hooks-cleanup" if flag.startswith("cleanup") else "rel-polykv-hooks-crds"
    assert gone not in jobs and len(jobs) == 2  # the other one, and the master key job


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
        {"name": "https", "port": 443, "targetPort": "ext-metrics", "protocol": "TCP"}
    ]
    # Nothing of the certificate is rendered: a hook job makes its Secret once (so two
    # renders, as Argo CD makes at every sync, are the same), and the operator sets the
    # APIService's caBundle from it.
    assert "Secret" not in kinds(docs) and "caBundle" not in api["spec"]
    assert render(tmp_path, None, "--set", "autoscaling.externalMetrics.enabled=true") == docs
    job = named(docs, "Job")["rel-polykv-operator-external-metrics-cert-job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert job["metadata"]["annotations"]["argocd.argoproj.io/hook"] == "PreSync"
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][3:] == [
        "external-metrics-tls",
        "--namespace=polykv-system",
        "--secret=rel-polykv-operator-external-metrics-cert",
        "--service=rel-polykv-operator-external-metrics",
    ]
    (dep,) = named(docs, "Deployment").values()
    (volume,) = (v for v in dep["spec"]["template"]["spec"]["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == "rel-polykv-operator-external-metrics-cert"
    assert env_of(docs)["POLYKV_OPERATOR_EXTERNAL_METRICS_CA"]["value"].endswith("/ca.crt")
    # The job's account reads the one Secret and the one APIService, by name.
    job_roles = [
        d for d in docs
        if d["kind"] in ("Role", "ClusterRole") and d["metadata"]["name"] == job["metadata"]["name"]
    ]  # fmt: skip
    assert sorted(r["kind"] for r in job_roles) == ["ClusterRole", "Role"]
    for role in job_roles:
        for rule in role["rules"]:
            assert rule.get("resourceNames") or rule["verbs"] == ["create"], rule
    # The operator's own policy on that APIService: the plain manifest has the same.
    policy = named(docs, "ValidatingAdmissionPolicy")["rel-polykv-operator-apiservice"]
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
    (plain_policy,) = (d for d in plain if d["kind"] == "ValidatingAdmissionPolicy")
    assert plain_policy["spec"]["validations"] == policy["spec"]["validations"]
    assert sorted(
        json.dumps(d["rules"], sort_keys=True) for d in plain if d["kind"] == "ClusterRole"
    ) == sorted(
        json.dumps(d["rules"], sort_keys=True)
        for d in docs
        if d["kind"] == "ClusterRole"
        and "external-metrics" in d["metadata"]["name"]
        and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})
    )
    (binding,) = (
        d
        for d in docs
        if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == "kube-system"
    )
    assert binding["roleRef"]["name"] == "extension-apiserver-authentication-reader"
    ingress = named(docs, "NetworkPolicy")["rel-polykv-operator"]["spec"]["ingress"]
    assert {"port": 6443, "protocol": "TCP"} in [p for rule in ingress for p in rule["ports"]]


def test_the_argocd_application_renders_as_argocd_renders_it(tmp_path: Path) -> None:
    """docs/application.yaml's values, rendered with no cluster to read (Argo CD runs `helm
    template`): they render, twice the same, and its API server addresses are what the
    operator and its jobs may reach."""
    app = yaml.safe_load((CHART / "docs" / "application.yaml").read_text())
    values = tmp_path / "argocd.yaml"
    values.write_text(yaml.safe_dump(app["spec"]["source"]["helm"]["valuesObject"]))
    args = ("template", "polykv", str(CHART), "-n", "polykv-system", "-f", str(values))
    first = helm(*args, offline=False).stdout
    assert helm(*args, offline=False).stdout == first
    docs = [d for d in yaml.safe_load_all(first) if d]
    egress = named(docs, "NetworkPolicy")["polykv-operator"]["spec"]["egress"][0]
    cidrs = app["spec"]["source"]["helm"]["valuesObject"]["networkPolicy"]["apiServer"]["cidrs"]
    assert [p["ipBlock"]["cidr"] for p in egress["to"]] == cidrs
