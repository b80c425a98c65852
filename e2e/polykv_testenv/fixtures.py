"""pytest fixtures over the harness. Import them in a conftest.py:

    from polykv_testenv.fixtures import (
        k8s_cluster, namespace, process_node, pytest_collection_modifyitems,
        pytest_runtest_makereport, run_operator,
    )

Session scope holds one control plane and one process node; `namespace` is fresh per test.
Fixtures are per conftest directory, so tests that must share one cluster live under one
conftest (tests/e2e/), or the import moves to tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from . import operator as op
from .bins import BinariesMissing, ensure_binaries
from .controlplane import ControlPlane
from .node import ProcessNode

__all__ = [
    "k8s_cluster",
    "namespace",
    "process_node",
    "pytest_collection_modifyitems",
    "pytest_runtest_makereport",
    "run_operator",
]


_BUILD_ERROR = pytest.StashKey[str]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Builds (or finds) the binaries before any test runs when a `k8s` test is selected:
    a cold build takes minutes and must not count against a test's timeout. Its progress
    goes straight to the terminal."""
    if not any(item.get_closest_marker("k8s") for item in items):
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        try:
            ensure_binaries()
        except BinariesMissing as exc:
            # The k8s tests then error (not skip) with this; the other tests still run.
            print(f"\npolykv_testenv: {exc}", file=sys.stderr)
            config.stash[_BUILD_ERROR] = str(exc)


@pytest.fixture(scope="session")
def k8s_cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback.
    KUBECONFIG points at it for the session (kopf and kubernetes clients read it)."""
    build_error = request.config.stash.get(_BUILD_ERROR, None)
    if build_error is not None:
        pytest.fail(f"no control-plane binaries: {build_error}", pytrace=False)
    cluster = ControlPlane(tmp_path_factory.mktemp("k8s") / "cluster")
    cluster.start()
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    try:
        yield cluster
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        cluster.stop()


@pytest.fixture(scope="session")
def process_node(
    k8s_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessNode]:
    node = ProcessNode(k8s_cluster.credentials, tmp_path_factory.mktemp("node"))
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def namespace(k8s_cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    k8s_cluster.api.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    )
    yield name
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        # Shown under the failed test: what the cluster looked like.
        for args in (("get", "all,events", "-o", "wide"), ("describe", "pods")):
            out = k8s_cluster.kubectl(*args, "-n", name, check=False)
            print(f"$ kubectl {' '.join(args)} -n {name}\n{out.stdout}{out.stderr}")
        print(f"component logs: {k8s_cluster.log_dir}")
    # No wait: the namespace controller finishes the job while other tests run.
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    # Lets `namespace` see whether the test body failed.
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def run_operator(
    k8s_cluster: ControlPlane, namespace: str, tmp_path: Path
) -> Iterator[Callable[..., contextlib.AbstractContextManager[Any]]]:
    """`with run_operator("polykv_operator.main") as runner:` runs kopf in this process
    (a KopfRunner) watching the test's namespace; `in_process=False` gives an
    OperatorProcess instead (kill() it to test crash recovery). Every OperatorProcess it
    handed out is stopped when the test ends, pass or fail, started or not by the test."""
    started: list[op.OperatorProcess] = []

    def start(
        target: str | Path, *, in_process: bool = True, all_namespaces: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        ns = None if all_namespaces else namespace
        if in_process:
            runner: contextlib.AbstractContextManager[Any] = op.in_process(target, ns)
            return runner
        proc = op.OperatorProcess(k8s_cluster, target, ns, tmp_path / "operator.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
