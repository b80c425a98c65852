"""What the operator's own credentials can and cannot do on the real API server.

The operator's ServiceAccount gets a token from the TokenRequest API (`kubectl create
token`), once with the RBAC and admission policy of operator/deploy/rbac.yaml, once with
those the chart renders (both for an operator serving every namespace). Each attack a
cluster-admin-like role would allow is tried with that token and refused: minting a
service-account token Secret, reading or patching a Secret that is not an engine's,
swapping a pod's image, running a Deployment as another ServiceAccount, binding a stronger
role. What the operator needs still passes. With `operator.watchNamespaces`, the chart's
Roles reach only those namespaces.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from polykv_testenv import ControlPlane

from ..helpers import Obj, eventually, get_or_none, kubeconfig_for

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[3]
OURS = {"app.kubernetes.io/managed-by": "polykv-operator", "polykv.io/engine": "eng"}
COST = "controller.kubernetes.io/pod-deletion-cost"
EXTERNAL_METRICS = "v1beta1.external.metrics.k8s.io"


class As:
    """Requests with one bearer token, answered as they come (no raising)."""

    def __init__(self, cluster: ControlPlane, token: str) -> None:
        self.http = httpx.Client(
            base_url=cluster.credentials.server,
            verify=ssl.create_default_context(cafile=str(cluster.credentials.ca_file)),
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )

    def call(
        self, method: str, path: str, body: Any = None, ctype: str = "application/json"
    ) -> httpx.Response:
        content = None if body is None else json.dumps(body)
        return self.http.request(method, path, content=content, headers={"Content-Type": ctype})


def token_of(kubeconfig: Path) -> str:
    return str(yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"])


@dataclass
class Identity:
    """The operator's account as one install makes it: its kubeconfig, a client with its
    token, and the router ClusterRole it binds."""

    kubeconfig: Path
    api: As
    router_role: str


def chart_rbac(
    cluster: ControlPlane, release: str, namespace: str, tmp_path: Path, values: Obj
) -> list[Obj]:
    """The chart's RBAC, admission policy and ServiceAccount, rendered (helm template: the
    API server's address is given) and applied in `namespace`."""
    path = tmp_path / f"{release}-values.yaml"
    offline = {"networkPolicy": {"apiServer": {"cidrs": ["10.0.0.1/32"]}}}
    path.write_text(yaml.safe_dump({**values, **offline}))
    rendered = cluster.helm(
        "template", release, str(ROOT / "helm" / "polykv"), "-n", namespace, "-f", str(path),
        "--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml",
    ).stdout  # fmt: skip
    cluster.apply(rendered)
    return [d for d in yaml.safe_load_all(rendered) if d]


def remove_cluster_scoped(cluster: ControlPlane, docs: list[Obj]) -> None:
    for d in docs:
        if "namespace" not in d["metadata"]:
            cluster.kubectl("delete", d["kind"], d["metadata"]["name"], check=False)


@pytest.fixture(params=["plain manifests", "rendered chart"])
def identity(
    request: pytest.FixtureRequest,
    k8s_cluster: ControlPlane,
    namespace: str,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> Iterator[Identity]:
    """operator/deploy/rbac.yaml's account, or the one the chart installs (serving every
    namespace) with the chart's own rendered RBAC and admission policy."""
    docs: list[Obj] = []
    if request.param == "plain manifests":
        kubeconfig, router_role = operator_kubeconfig, "polykv-router"
    else:
        release = f"rbac-{namespace}"
        docs = chart_rbac(k8s_cluster, release, namespace, tmp_path, {})
        account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
        token = k8s_cluster.kubectl(
            "create", "token", account, "-n", namespace, "--duration=1h"
        ).stdout.strip()
        kubeconfig = kubeconfig_for(k8s_cluster, token, tmp_path / "chart-kubeconfig")
        router_role = f"{release}-polykv-operator-router"
    client = As(k8s_cluster, token_of(kubeconfig))
    try:
        yield Identity(kubeconfig, client, router_role)
    finally:
        client.http.close()
        remove_cluster_scoped(k8s_cluster, docs)


def can_i_list(
    cluster: ControlPlane, kubeconfig: Path, namespace: str
) -> tuple[dict[str, set[str]], dict[str, dict[str, set[str]]]]:
    """`kubectl auth can-i --list` as the kubeconfig's user: resource -> verbs for rules on
    every object of a kind, and resource -> {name: verbs} for rules scoped by resourceNames."""
    out = cluster.kubectl(
        "--kubeconfig", str(kubeconfig), "auth", "can-i", "--list", "-n", namespace
    ).stdout
    table: dict[str, set[str]] = {}
    named: dict[str, dict[str, set[str]]] = {}
    for line in out.splitlines()[1:]:
        cols = line.split()
        # Non-resource URL lines (discovery's [/api/*] get) start with their "[...]" column.
        if not cols or cols[0].startswith("[") or not cols[-1].endswith("]"):
            continue
        resource = cols[0]
        # Columns: resource, [non-resource URLs], [resource names], [verbs].
        _, names, verbs = (
            g.strip().strip("[]").split() for g in line[len(resource) :].split("]")[:-1]
        )
        if names:
            for name in names:
                named.setdefault(resource, {}).setdefault(name, set()).update(verbs)
        else:
            table.setdefault(resource, set()).update(verbs)
    return table, named


def secret(name: str, labels: dict[str, str] | None = None, **extra: Any) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": labels or {}},
        "stringData": {"password": "hunter2"},
        **extra,
    }


def pending_pod(name: str, labels: dict[str, str]) -> Obj:
    """A pod no node will run (its nodeSelector matches none): an object to patch."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {"polykv.io/no-such-node": "true"},
            "containers": [{"name": "app", "image": "polykv/testserver:1"}],
        },
    }


def replicaset_pod(cluster: ControlPlane, namespace: str, engine: str) -> str:
    """The pod of a ReplicaSet named like an engine Deployment's (<engine>-<hash>), made as
    that Deployment would make it; no node runs it."""
    hash_ = "5d8f7c9b4"
    labels = {**OURS, "polykv.io/engine": engine, "pod-template-hash": hash_}
    template = pending_pod("", labels)
    del template["metadata"]["name"]
    replicaset = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": f"{engine}-{hash_}", "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": template},
    }
    cluster.api.create(f"/apis/apps/v1/namespaces/{namespace}/replicasets", replicaset)

    def probe() -> str | None:
        pods = cluster.api.get(
            f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"pod-template-hash={hash_}"
        )["items"]
        return str(pods[0]["metadata"]["name"]) if pods else None

    return eventually(f"the pod of ReplicaSet {engine}-{hash_}", probe, 60)


def refused(resp: httpx.Response) -> bool:
    return resp.status_code == 403


def test_the_operators_token_cannot_mint_tokens_read_secrets_or_swap_images(
    k8s_cluster: ControlPlane, namespace: str, identity: Identity
) -> None:
    operator_api = identity.api
    ns = f"/api/v1/namespaces/{namespace}"
    # A new ValidatingAdmissionPolicy is enforced once the API server's admission plugin
    # has read it: wait until a write it refuses (a dry run) is refused.
    eventually(
        "the admission policy is in effect",
        lambda: (
            True
            if refused(operator_api.call("POST", f"{ns}/secrets?dryRun=All", secret("probe", OURS)))
            else None
        ),
        60,
    )
    table, named = can_i_list(k8s_cluster, identity.kubeconfig, namespace)
    print("can-i --list:", json.dumps({k: sorted(v) for k, v in sorted(table.items())}))
    print(
        "by name:", json.dumps({k: {n: sorted(v) for n, v in d.items()} for k, d in named.items()})
    )
    assert table["secrets"] == {"create", "patch"}  # never get, list or watch
    assert "*" not in table and "*.*" not in table
    assert not any("*" in verbs or "get" in verbs for verbs in table.values()), table
    assert "roles.rbac.authorization.k8s.io" not in table
    assert "pods/exec" not in table
    # The one rule by name: the APIService the operator serves behind (read, and its
    # caBundle set), and only when the opt-in external metrics API's rules
    # (external-metrics-rbac.yaml) are applied, as the autoscaling tests on this cluster do.
    by_name = {"apiservices.apiregistration.k8s.io": {EXTERNAL_METRICS: {"get", "patch"}}}
    assert named in ({}, by_name)

    # Another team's Secret: not readable, and a patch (which answers with the object) is
    # refused before it returns anything, even under an engine's Secret name.
    k8s_cluster.api.create(f"{ns}/secrets", secret("theirs"))
    k8s_cluster.api.create(f"{ns}/secrets", secret("theirs-polykv-admin"))
    for name in ("theirs", "theirs-polykv-admin"):
        got = operator_api.call("GET", f"{ns}/secrets/{name}")
        assert refused(got), got.text
        patched = operator_api.call(
            "PATCH", f"{ns}/secrets/{name}", {"metadata": {"labels": OURS}},
            "application/merge-patch+json",
        )  # fmt: skip
        assert refused(patched) and "hunter2" not in patched.text, patched.text
        assert "aHVudGVyMg" not in patched.text  # base64 of it
    listed = operator_api.call("GET", f"{ns}/secrets")
    assert refused(listed), listed.text

    # Minting a token for the namespace's default account, under any name and labels.
    for name in ("mint", "default-polykv-admin"):
        body = secret(
            name,
            OURS,
            type="kubernetes.io/service-account-token",
        )
        body["metadata"]["annotations"] = {"kubernetes.io/service-account.name": "default"}
        minted = operator_api.call("POST", f"{ns}/secrets", body)
        assert refused(minted), minted.text
        assert get_or_none(k8s_cluster.api, f"{ns}/secrets/{name}") is None

    # An engine's admin Secret, as the operator writes it, is accepted.
    mine = operator_api.call("POST", f"{ns}/secrets", secret("eng-polykv-admin", OURS))
    assert mine.status_code == 201, mine.text

    # Pods: no pod gets a new image. Another team's pod, and one that carries the engine
    # labels but that no ReplicaSet <engine>-<pod-template-hash> controls, get nothing
    # else either; a pod of an engine's ReplicaSet may get its deletion cost and readiness
    # gate, nothing else.
    k8s_cluster.api.create(f"{ns}/pods", pending_pod("theirs", {"app": "theirs"}))
    k8s_cluster.api.create(f"{ns}/pods", pending_pod("eng-0", OURS))
    replica = replicaset_pod(k8s_cluster, namespace, "eng")
    swap = {"spec": {"containers": [{"name": "app", "image": "evil/miner:1"}]}}
    for name in ("theirs", "eng-0", replica):
        r = operator_api.call(
            "PATCH", f"{ns}/pods/{name}", swap, "application/strategic-merge-patch+json"
        )
        assert refused(r), r.text
        live = k8s_cluster.api.get(f"{ns}/pods/{name}")
        assert live["spec"]["containers"][0]["image"] == "polykv/testserver:1"
    cost = {"metadata": {"annotations": {COST: "3"}}}
    gate = {"status": {"conditions": [{"type": "polykv.io/pools-ready", "status": "True"}]}}
    for name in ("theirs", "eng-0"):
        r = operator_api.call("PATCH", f"{ns}/pods/{name}", cost, "application/merge-patch+json")
        assert refused(r), r.text
        r = operator_api.call(
            "PATCH", f"{ns}/pods/{name}/status", gate, "application/strategic-merge-patch+json"
        )
        assert refused(r), r.text
    r = operator_api.call("PATCH", f"{ns}/pods/{replica}", cost, "application/merge-patch+json")
    assert r.status_code == 200, r.text
    relabel = {"metadata": {"labels": {"polykv.io/engine": "other"}}}
    r = operator_api.call("PATCH", f"{ns}/pods/{replica}", relabel, "application/merge-patch+json")
    assert refused(r), r.text
    orphan = {"metadata": {"ownerReferences": None}}
    r = operator_api.call("PATCH", f"{ns}/pods/{replica}", orphan, "application/merge-patch+json")
    assert refused(r), r.text
    r = operator_api.call(
        "PATCH", f"{ns}/pods/{replica}/status", gate, "application/strategic-merge-patch+json"
    )
    assert r.status_code == 200, r.text
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    r = operator_api.call(
        "PATCH", f"{ns}/pods/{replica}/status", ready, "application/strategic-merge-patch+json"
    )
    assert refused(r), r.text

    # A Deployment runs as the default account without a token, or as a router's own.
    apps = f"/apis/apps/v1/namespaces/{namespace}/deployments"

    def deployment(name: str, account: str | None, labels: dict[str, str]) -> Obj:
        pod: Obj = {
            "automountServiceAccountToken": False,
            "containers": [{"name": "app", "image": "polykv/testserver:1"}],
        }
        if account:
            pod["serviceAccountName"] = account
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"x": name}},
                "template": {"metadata": {"labels": {"x": name}}, "spec": pod},
            },
        }

    r = operator_api.call("POST", apps, deployment("sneaky", "kube-admin", OURS))
    assert refused(r), r.text
    r = operator_api.call("POST", apps, deployment("unlabelled", None, {}))
    assert refused(r), r.text
    r = operator_api.call("POST", apps, deployment("eng", None, OURS))
    assert r.status_code == 201, r.text

    # Binding cluster-admin (or anything but the router role) to anyone is refused.
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings"
    binding: Obj = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "eng-router-pod-reader", "labels": OURS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ""},
        "subjects": [{"kind": "ServiceAccount", "name": "eng-router", "namespace": namespace}],
    }
    for role in ("cluster-admin", "edit"):
        binding["roleRef"]["name"] = role
        r = operator_api.call("POST", rbac, binding)
        assert refused(r), r.text
    binding["roleRef"]["name"] = identity.router_role
    r = operator_api.call("POST", rbac, binding)
    assert r.status_code == 201, r.text
    for name in ("other", "eng-router"):  # the subject is not the binding's own account
        binding["metadata"]["name"] = name
        r = operator_api.call("POST", rbac, binding)
        assert refused(r), r.text
    # Nor may an update give the binding to another account.
    elsewhere = {
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]
    }
    r = operator_api.call(
        "PATCH", f"{rbac}/eng-router-pod-reader", elsewhere, "application/merge-patch+json"
    )
    assert refused(r), r.text

    # Kube-system is no different: no pod there gets a new image.
    system = "/api/v1/namespaces/kube-system/pods"
    victim = f"victim-{namespace}"
    k8s_cluster.api.create(system, pending_pod(victim, {"tier": "control-plane", **OURS}))
    try:
        r = operator_api.call(
            "PATCH", f"{system}/{victim}", swap, "application/strategic-merge-patch+json"
        )
        assert refused(r), r.text
    finally:
        k8s_cluster.api.delete(f"{system}/{victim}", {"gracePeriodSeconds": 0})


def test_watch_namespaces_confine_the_operator_to_them(
    k8s_cluster: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """The chart rendered with operator.watchNamespaces=[namespace]: a Role there, nothing
    namespaced anywhere else (another namespace, cluster-wide)."""
    release = f"scoped-{namespace}"
    values = {"operator": {"watchNamespaces": [namespace]}}
    docs = chart_rbac(k8s_cluster, release, namespace, tmp_path, values)
    assert {d["kind"] for d in docs} >= {"ClusterRole", "Role", "RoleBinding", "ServiceAccount"}
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    token = k8s_cluster.kubectl(
        "create", "token", account, "-n", namespace, "--duration=1h"
    ).stdout.strip()
    client = As(k8s_cluster, token)
    try:
        here = f"/apis/apps/v1/namespaces/{namespace}/deployments"
        # The Role's binding may take a moment to reach the authorizer's cache.
        eventually(
            "the Role is in effect",
            lambda: (
                True
                if client.call("POST", f"{here}?dryRun=All", _plain_deployment()).status_code
                in (201, 200)
                else None
            ),
            30,
        )
        for path in (
            "/apis/apps/v1/namespaces/default/deployments?dryRun=All",
            "/api/v1/namespaces/default/services?dryRun=All",
        ):
            body = _plain_deployment() if "deployments" in path else _plain_service()
            r = client.call("POST", path, body)
            assert refused(r), (path, r.text)
        for path in ("/api/v1/pods", "/api/v1/namespaces/default/pods", "/api/v1/secrets"):
            r = client.call("GET", path)
            assert refused(r), (path, r.text)
        r = client.call("GET", f"/api/v1/namespaces/{namespace}/pods")
        assert r.status_code == 200, r.text
        r = client.call("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
        assert r.status_code == 200, r.text
    finally:
        client.http.close()
        remove_cluster_scoped(k8s_cluster, docs)


def _plain_deployment() -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "probe",
            "labels": {"app.kubernetes.io/managed-by": "polykv-operator"},
        },
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"x": "probe"}},
            "template": {
                "metadata": {"labels": {"x": "probe"}},
                "spec": {
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "app", "image": "polykv/testserver:1"}],
                },
            },
        },
    }


def _plain_service() -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "probe",
            "labels": {"app.kubernetes.io/managed-by": "polykv-operator"},
        },
        "spec": {"selector": {"x": "probe"}, "ports": [{"port": 80}]},
    }
