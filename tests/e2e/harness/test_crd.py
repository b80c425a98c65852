"""A CRD with a status subresource and CEL rules, served by the real apiextensions server."""

from __future__ import annotations

import pytest

from polykv_testenv import ApiError, ControlPlane

from ..helpers import GROUP, WIDGETS, install_widget_crd

pytestmark = pytest.mark.k8s


def widget(name: str, size: int = 3, mode: str = "fast") -> dict[str, object]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"mode": mode, "size": size},
    }


def test_create_status_round_trip_and_cel_rejection(
    k8s_cluster: ControlPlane, namespace: str
) -> None:
    api = k8s_cluster.api
    install_widget_crd(k8s_cluster)
    base = WIDGETS.format(ns=namespace)

    created = api.create(base, widget("w1"))
    assert created["spec"] == {"mode": "fast", "size": 3}
    assert "status" not in created

    # The status subresource takes status and ignores spec...
    api.patch(f"{base}/w1/status", {"status": {"phase": "Ready", "observedSize": 3}})
    got = api.get(f"{base}/w1")
    assert got["status"] == {"phase": "Ready", "observedSize": 3}
    # ...and the main resource ignores status.
    api.patch(f"{base}/w1", {"spec": {"size": 4}, "status": {"phase": "Hacked"}})
    got = api.get(f"{base}/w1")
    assert got["spec"]["size"] == 4
    assert got["status"]["phase"] == "Ready"

    # A transition rule (self == oldSelf) rejects the update with its message.
    with pytest.raises(ApiError) as rejected:
        api.patch(f"{base}/w1", {"spec": {"mode": "slow"}})
    assert rejected.value.status == 422
    assert "mode is immutable" in rejected.value.message
    assert api.get(f"{base}/w1")["spec"]["mode"] == "fast"

    # A plain rule rejects creation.
    with pytest.raises(ApiError) as too_big:
        api.create(base, widget("w2", size=11))
    assert too_big.value.status == 422
    assert "size above 10" in too_big.value.message
