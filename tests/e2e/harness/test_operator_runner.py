"""The run_operator fixture: a kopf operator in this process and as a child process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from polykv_testenv import ControlPlane

from ..helpers import GROUP, WIDGETS, eventually, install_widget_crd

pytestmark = pytest.mark.k8s

OPERATOR = Path(__file__).parent / "operators" / "widget_status.py"


def create_and_wait_seen(cluster: ControlPlane, namespace: str, name: str) -> None:
    base = WIDGETS.format(ns=namespace)
    body = {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"mode": "fast", "size": 2},
    }
    cluster.api.create(base, body)
    eventually(
        f"{name} seen by the operator",
        lambda: (
            (cluster.api.get(f"{base}/{name}").get("status") or {}).get("phase") == "Seen" or None
        ),
        180,  # kopf's first list-watch and handler on a loaded 2-core machine
    )


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "subprocess"])
def test_operator_reconciles_a_widget(
    k8s_cluster: ControlPlane,
    namespace: str,
    run_operator: Callable[..., Any],
    in_process: bool,
) -> None:
    install_widget_crd(k8s_cluster)
    with run_operator(OPERATOR, in_process=in_process) as runner:
        create_and_wait_seen(k8s_cluster, namespace, "w1")
    if in_process:
        assert runner.exception is None, runner.output
        assert runner.exit_code == 0, runner.output
    else:
        assert "Handler 'seen' succeeded" in runner.log()
