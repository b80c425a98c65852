"""What the operator reads from an engine pod, and what it forgets about a released pool."""

from __future__ import annotations

import httpx

from polykv_operator.fleet import CreateError, EngineState, Render, ReplicaRef
from polykv_operator.names import http_url

from .builders import NS


def test_replica_ref_from_a_pod() -> None:
    body = {
        "metadata": {"name": "e-1", "uid": "u1", "deletionTimestamp": None},
        "status": {
            "podIP": "127.0.0.3",
            "conditions": [
                {"type": "Ready", "status": "False"},
                {"type": "polykv.io/pools-ready", "status": "True"},
            ],
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": True,
                    "restartCount": 2,
                    "state": {"running": {"startedAt": "now"}},
                }
            ],
        },
    }
    ref = ReplicaRef.from_pod(body)
    assert (ref.name, ref.uid) == ("e-1", "u1")
    assert (ref.ip, ref.running, ref.ready, ref.gate, ref.restarts) == (
        "127.0.0.3",
        True,
        True,
        "True",
        2,
    )
    assert not ref.terminating
    waiting = {
        "metadata": {"name": "e-2", "uid": "u2", "deletionTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "containerStatuses": [
                {"name": "engine", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
            ]
        },
    }
    ref = ReplicaRef.from_pod(waiting)
    assert ref.terminating and not ref.running and ref.waiting_reason == "CrashLoopBackOff"
    assert ref.gate is None and ref.ip is None


def test_forget_pool_drops_everything_about_it() -> None:
    st = EngineState((NS, "eng"))
    st.renders["u"] = st.renders["keep"] = Render(1, 0, "h")
    st.create_errors["u"] = {"a": CreateError("full", "seq_ids_exhausted")}
    st.deleting.add("u")
    st.forget_pool("u")
    assert list(st.renders) == ["keep"] and not st.create_errors
    assert st.deleting == {"u"}  # until the object is gone (the round prunes it)


def test_a_pod_url_brackets_an_ipv6_address() -> None:
    assert http_url("10.0.0.5", 8080) == "http://10.0.0.5:8080"
    assert http_url("fd00::5", 8080) == "http://[fd00::5]:8080"
    assert httpx.URL(http_url("fd00::5", 9090) + "/metrics").port == 9090
