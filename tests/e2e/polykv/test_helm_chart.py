"""The Helm chart on the local control plane, with the real operator, engines and helm.

One release per test namespace (the operator watches only that namespace, so other tests'
objects are not its business): install -> the operator pod runs (its image maps to the
`polykv-operator` command, logged in with its own ServiceAccount token) -> the engine, the
policy and the pool tree from values become Ready -> `helm test` passes -> `helm upgrade`
with a changed value rolls the operator and its pre-upgrade job restores a drifted CRD ->
`helm uninstall` releases every pool (the pre-delete job, while the operator still runs)
and leaves no PolyKV object, Deployment or pod behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from polykv_testenv import ControlPlane, ProcessNode

from ..helpers import Obj, eventually, fetch_if, gone, is_ready

pytestmark = [pytest.mark.k8s]

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "polykv"
ALERTS = CHART / "files" / "alerts.yaml"
DASHBOARD = CHART / "files" / "dashboards" / "polykv.json"
GROUP = "/apis/polykv.io/v1alpha1/namespaces/{ns}/{plural}"

SYSTEM = {"role": "system", "content": "You are the research crew. Cite sources, be brief."}
BRIEF = {"role": "user", "content": "Task briefing: survey shared-prefix KV caching."}


def release_values(namespace: str) -> dict[str, Any]:
    engine = {"name": "pkv"}
    return {
        "operator": {"watchNamespaces": [namespace], "pollIntervalSeconds": 0.5},
        "cleanup": {"timeoutSeconds": 120},
        "tests": {"timeoutSeconds": 120},
        "engines": [
            {
                "name": "pkv",
                "spec": {
                    "model": {
                        "path": "/models/polykv-test.gguf",
                        "init": {
                            "command": [
                                "polykv-make-model",
                                "--preset",
                                "test",
                                "/models/polykv-test.gguf",
                            ]
                        },
                    },
                    "replicas": 1,
                    "parallel": 2,
                    "contextSize": 2048,
                    "maxPools": 8,
                    "threads": 1,
                },
            }
        ],
        "pools": [
            {
                "name": "crew",
                "labels": {"tier": "interactive"},
                "spec": {"engineRef": engine, "messages": [SYSTEM], "pin": True},
            },
            {
                "name": "planner",
                "labels": {"tier": "interactive"},
                "spec": {"engineRef": engine, "parent": "crew", "appendMessages": [BRIEF]},
            },
        ],
        "admissionPolicies": [
            {
                "name": "floor",
                "spec": {
                    "poolSelector": {"matchLabels": {"tier": "interactive"}},
                    "targetTpsPerSession": 1,
                    "mode": "advisory",
                },
            }
        ],
    }


def polykv(api: Any, ns: str, plural: str, name: str = "") -> str:
    base = GROUP.format(ns=ns, plural=plural)
    return f"{base}/{name}" if name else base


def operator_pods(cluster: ControlPlane, ns: str, release: str) -> list[Obj]:
    selector = f"app.kubernetes.io/name=polykv-operator,app.kubernetes.io/instance={release}"
    items: list[Obj] = cluster.api.get(f"/api/v1/namespaces/{ns}/pods", labelSelector=selector)[
        "items"
    ]
    return items


def running_operator(cluster: ControlPlane, ns: str, release: str, not_uid: str = "") -> Obj:
    def probe() -> Obj | None:
        for pod in operator_pods(cluster, ns, release):
            statuses = (pod.get("status") or {}).get("containerStatuses") or []
            if pod["metadata"]["uid"] != not_uid and statuses and statuses[0].get("ready"):
                return pod
        return None

    return eventually("operator pod running", probe, timeout_s=120)


def kubectl_plugin(cluster: ControlPlane, *args: str) -> str:
    env = cluster.tool_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    out = subprocess.run(
        [str(Path(cluster.bin_dir or "") / "kubectl"), "polykv", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return out.stdout


def exported_names(scrape: str) -> set[str]:
    """Metric names in a Prometheus text scrape: HELP/TYPE lines (families with no sample
    yet) and sample lines."""
    names = set(re.findall(r"^# (?:HELP|TYPE) (\w+)", scrape, re.M))
    return names | set(re.findall(r"^(\w+)(?:\{|\s)", scrape, re.M))


def monitoring_metric_names() -> set[str]:
    """Every polykv_ metric the chart's alert rules and dashboard query."""
    exprs = [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    dash = json.loads(DASHBOARD.read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return set(re.findall(r"\b(polykv_\w+)", " ".join(exprs)))


def pod_log(node: ProcessNode, namespace: str, pod: str) -> str:
    """The container's log as the process node wrote it (no kubelet serves `kubectl logs`;
    the pod object itself is gone once it succeeded)."""
    logs = sorted((node.state_dir / "pods").glob(f"{namespace}_{pod}_*/logs/*/*.log"))
    return "".join(p.read_text(errors="replace") for p in logs)


@pytest.fixture
def release(k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str) -> Iterator[str]:
    """The release name; whatever the test leaves installed is uninstalled."""
    k8s_cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    name = f"pk-{uuid.uuid4().hex[:6]}"
    yield name
    k8s_cluster.helm("uninstall", name, "-n", namespace, "--timeout", "180s", check=False)


@pytest.mark.slow
def test_install_test_upgrade_uninstall(
    k8s_cluster: ControlPlane,
    process_node: ProcessNode,
    namespace: str,
    release: str,
    tmp_path: Path,
) -> None:
    api = k8s_cluster.api
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(release_values(namespace)))

    t0 = time.monotonic()
    k8s_cluster.helm(
        "install", release, str(CHART), "-n", namespace, "-f", str(values),
        "--wait", "--timeout", "180s",
        timeout_s=240,
    )  # fmt: skip
    first = running_operator(k8s_cluster, namespace, release)
    for plural, name in (
        ("polykvengines", "pkv"),
        ("admissionpolicies", "floor"),
        ("polykvpools", "crew"),
        ("polykvpools", "planner"),
    ):
        eventually(
            f"{plural}/{name} Ready",
            lambda p=plural, n=name: fetch_if(api, polykv(api, namespace, p, n), is_ready),
            timeout_s=180,
        )
    installed_s = time.monotonic() - t0
    planner = api.get(polykv(api, namespace, "polykvpools", "planner"))
    assert planner["status"]["path"] == "crew/planner"
    assert planner["status"]["admissionPolicy"] == "floor"

    # The kubectl plugin (kubectl finds kubectl-polykv on PATH) draws the tree.
    tree = kubectl_plugin(k8s_cluster, "tree", "-n", namespace)
    name, length, branch = tree.splitlines()[1].split()[:3]
    assert (name, length.isdigit(), branch) == ("crew", True, "0"), tree
    assert tree.splitlines()[2].startswith("└── planner") and tree.rstrip().endswith("True")

    # Every metric the alerts and the dashboard name is in a real scrape of the two.
    engine = api.get(polykv(api, namespace, "polykvengines", "pkv"))
    scraped = exported_names(
        httpx.get(f"http://{first['status']['podIP']}:9090/metrics", timeout=10).text
        + httpx.get(
            f"http://{engine['status']['replicaStatus'][0]['podIP']}:8080/metrics", timeout=10
        ).text
    )
    named = monitoring_metric_names()
    assert named - scraped == set(), f"not exported: {sorted(named - scraped)}"

    # The chart-generated master key: what an upgrade must keep.
    secret_path = f"/api/v1/namespaces/{namespace}/secrets/{release}-polykv-master-key"
    key_before = api.get(secret_path)["data"]["master-key"]

    t0 = time.monotonic()
    out = k8s_cluster.helm("test", release, "-n", namespace, timeout_s=240)
    tested_s = time.monotonic() - t0
    assert "Phase:          Succeeded" in out.stdout, out.stdout
    log = pod_log(process_node, namespace, f"{release}-polykv-test")
    assert "every check passed" in log and "holds ['crew', 'planner']" in log, log

    # A drifted CRD (what an older chart would have left): the pre-upgrade job replaces it.
    crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/polykvpools.polykv.io"
    shipped = yaml.safe_load((CHART / "crds" / "polykvpools.polykv.io.yaml").read_text())
    column = shipped["spec"]["versions"][0]["additionalPrinterColumns"][0]
    api.patch(
        crd,
        [
            {
                "op": "replace",
                "path": "/spec/versions/0/additionalPrinterColumns/0/description",
                "value": "stale",
            }
        ],
        content_type="application/json-patch+json",
    )
    t0 = time.monotonic()
    k8s_cluster.helm(
        "upgrade", release, str(CHART), "-n", namespace, "-f", str(values),
        "--set", "operator.pollIntervalSeconds=1", "--wait", "--timeout", "180s",
        timeout_s=240,
    )  # fmt: skip
    second = running_operator(k8s_cluster, namespace, release, not_uid=first["metadata"]["uid"])
    upgraded_s = time.monotonic() - t0
    env = {e["name"]: e.get("value") for e in second["spec"]["containers"][0]["env"]}
    assert env["POLYKV_OPERATOR_POLL_INTERVAL"] == "1"
    # A rolling update (peering: the old and the new pod never both act): the old pod goes
    # once the new one is ready.
    eventually(
        "the first operator pod gone",
        lambda: gone(api, f"/api/v1/namespaces/{namespace}/pods/{first['metadata']['name']}"),
        timeout_s=120,
    )
    live = api.get(crd)["spec"]["versions"][0]["additionalPrinterColumns"][0]
    assert live.get("description") == column.get("description")
    assert api.get(secret_path)["data"]["master-key"] == key_before
    # The new operator adopts the tree: still Ready on the same engine.
    eventually(
        "pools Ready under the new operator",
        lambda: fetch_if(api, polykv(api, namespace, "polykvpools", "planner"), is_ready),
        timeout_s=120,
    )

    t0 = time.monotonic()
    k8s_cluster.helm(
        "uninstall", release, "-n", namespace, "--wait", "--timeout", "180s", timeout_s=240
    )
    uninstalled_s = time.monotonic() - t0
    for plural in ("polykvpools", "admissionpolicies", "polykvengines"):
        assert api.get(polykv(api, namespace, plural))["items"] == []
    eventually(
        "engine Deployment gone",
        lambda: gone(api, f"/apis/apps/v1/namespaces/{namespace}/deployments/pkv"),
    )
    eventually(
        "every pod gone",
        lambda: True if not api.get(f"/api/v1/namespaces/{namespace}/pods")["items"] else None,
        timeout_s=120,
    )
    print(
        json.dumps(
            {
                "install_to_ready_s": round(installed_s, 1),
                "helm_test_s": round(tested_s, 1),
                "upgrade_s": round(upgraded_s, 1),
                "uninstall_s": round(uninstalled_s, 1),
            }
        )
    )


def test_rendered_chart_passes_server_side_dry_run(
    k8s_cluster: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """Every object the chart renders (hooks and the test pod included), with engines, pools
    and policies from values, is accepted by the API server: schemas, CRD validation (CEL
    rules included) and the restricted Pod Security admission of the namespace."""
    k8s_cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    # The chart's crds/ (what helm install applies first), for real: the objects need them.
    k8s_cluster.kubectl("apply", "-f", str(CHART / "crds"))
    k8s_cluster.kubectl(
        "wait", "--for=condition=Established", "crd", "-l", "app.kubernetes.io/part-of=polykv"
    )
    values = tmp_path / "values.yaml"
    # With the opt-in external metrics API too: its admission policy's CEL is compiled by
    # the API server.
    em = {"autoscaling": {"externalMetrics": {"enabled": True}}}
    values.write_text(yaml.safe_dump({**release_values(namespace), **em}))
    # --dry-run=server: the chart reads the API server's address from the cluster.
    rendered = k8s_cluster.helm(
        "template", "dry", str(CHART), "-n", namespace, "-f", str(values), "--dry-run=server"
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert len(docs) > 20
    (operator_policy,) = (
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "dry-polykv-operator"
    )
    service_ip = k8s_cluster.api.get("/api/v1/namespaces/default/services/kubernetes")["spec"][
        "clusterIP"
    ]
    assert operator_policy["spec"]["egress"][0]["to"] == [{"ipBlock": {"cidr": f"{service_ip}/32"}}]
    out = k8s_cluster.kubectl(
        # Every rendered object names its namespace (one is in kube-system: the
        # front-proxy CA reader's binding).
        "apply",
        "--dry-run=server",
        "-f",
        "-",
        input=rendered,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr  # a PSA warning would show here
    created = out.stdout.count("(server dry run)")
    assert created == len(docs), out.stdout
