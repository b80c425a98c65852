"""The install commands of docs/install.md, run verbatim (bash, from the repository root)
on a control plane of their own: the operator they install serves every namespace and takes
the names polykv-system and polykv-operator, which the other tests' cluster must not share.

The Helm block runs first; after `helm uninstall` the plain-manifest block runs on the same
cluster (the CRDs and the chart's kept master key stay, as they would for a user). After
each, the operator pod must be running and bring an engine and a pool tree to Ready.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from polykv_testenv import ControlPlane, ProcessNode

from ..helpers import eventually, fetch_if, is_ready
from .test_helm_chart import release_values

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


INSTALL_PAGE = ROOT / "docs" / "install.md"


def readme_block(name: str) -> list[str]:
    """The command lines of the install page's fenced block marked `readme-test:<name>`."""
    text = INSTALL_PAGE.read_text()
    m = re.search(
        rf"<!-- readme-test:{name} -->\n```bash\n(.*?)```\n<!-- /readme-test -->", text, re.S
    )
    assert m is not None, f"{INSTALL_PAGE.name} has no readme-test:{name} block"
    return [ln for ln in m.group(1).splitlines() if ln.strip() and not ln.startswith("#")]


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    base = tmp_path_factory.mktemp("readme")
    cluster = ControlPlane(base / "cluster")
    cluster.start()
    node = ProcessNode(cluster.credentials, base / "node")
    node.start()
    try:
        yield cluster
    finally:
        node.stop()
        cluster.stop()


def run_block(cluster: ControlPlane, name: str) -> None:
    for line in readme_block(name):
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", line],
            cwd=ROOT,
            env=cluster.tool_env(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, f"install line failed: {line}\n{out.stdout}\n{out.stderr}"


def operator_serves(cluster: ControlPlane, namespace: str) -> None:
    """The installed operator brings a (generated-model) engine and a pool tree to Ready."""
    values = release_values(namespace)
    cluster.kubectl("create", "namespace", namespace)
    for kind, key in (("PolyKVEngine", "engines"), ("PolyKVPool", "pools")):
        for o in values[key]:
            meta = {"name": o["name"], "labels": o.get("labels", {})}
            obj = {"apiVersion": "polykv.io/v1alpha1", "kind": kind, "metadata": meta}
            cluster.apply({**obj, "spec": o["spec"]}, namespace)
    base = f"/apis/polykv.io/v1alpha1/namespaces/{namespace}"
    for path in (f"{base}/polykvengines/pkv", f"{base}/polykvpools/planner"):
        eventually(
            f"{path} Ready", lambda p=path: fetch_if(cluster.api, p, is_ready), timeout_s=180
        )


def test_helm_block_then_plain_manifests_block(own_cluster: ControlPlane) -> None:
    run_block(own_cluster, "helm")
    operator_serves(own_cluster, "agents")
    own_cluster.helm("uninstall", "polykv", "-n", "polykv-system", "--wait", timeout_s=300)
    # The pre-delete job released and removed everything the operator served.
    assert own_cluster.api.get("/apis/polykv.io/v1alpha1/polykvpools")["items"] == []

    run_block(own_cluster, "kubectl")
    operator_serves(own_cluster, "agents-2")

    def phases() -> list[str] | None:
        pods = own_cluster.api.get(
            "/api/v1/namespaces/polykv-system/pods",
            labelSelector="app.kubernetes.io/name=polykv-operator",
        )["items"]
        found = sorted(p["status"]["phase"] for p in pods)
        return found if found == ["Running", "Running"] else None

    # The plain manifests run two replicas with kopf peering (one acts, one stands by).
    eventually("both operator replicas running", phases, timeout_s=120)
