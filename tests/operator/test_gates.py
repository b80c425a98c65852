"""Readiness gate decisions."""

from __future__ import annotations

from polykv_operator.fleet import Observation, ReplicaRef, Synced, boot_named
from polykv_operator.gates import decide, must_drop
from polykv_operator.names import GATE

from .builders import pod
from .fake_engine import FakeEngine


def obs(boot: str = "b1", reachable: bool = True) -> Observation:
    eng = FakeEngine(boot_id=boot)
    return Observation(
        "p", "uid-p", "1.2.3.4", reachable, None, eng.listing() if reachable else None
    )


def test_new_replica_rises_only_when_complete() -> None:
    p = pod("p", "1.2.3.4")
    assert decide(p, obs(), None, complete=False, n_pools=3).status is False  # type: ignore[union-attr]
    up = decide(p, obs(), None, complete=True, n_pools=3)
    assert up is not None and up.status and up.reason == "PoolsMaterialized"


def test_serving_replica_is_repaired_in_place() -> None:
    p = pod("p", "1.2.3.4", gate="True")
    assert decide(p, obs(), Synced("b1", 0), complete=False, n_pools=3) is None


def test_restart_drops_the_gate() -> None:
    p = pod("p", "1.2.3.4", gate="True")
    want = decide(p, obs("b2"), Synced("b1", 0), complete=False, n_pools=3)
    assert want is not None and not want.status and want.reason == "EngineRestarted"
    want = decide(pod("p", "1.2.3.4", gate="True", restarts=1), obs(), Synced("b1", 0), False, 3)
    assert want is not None and want.reason == "EngineRestarted"


def test_operator_restart_verifies_before_trusting_a_true_gate() -> None:
    p = pod("p", "1.2.3.4", gate="True")  # no boot named: verified by the tree
    assert decide(p, obs(), None, complete=True, n_pools=1) is not None  # stays True
    assert decide(p, obs(), None, complete=False, n_pools=1).status is False  # type: ignore[union-attr]


def test_operator_restart_trusts_the_boot_the_gate_names() -> None:
    up = decide(pod("p", "1.2.3.4"), obs("b1"), None, complete=True, n_pools=2)
    assert up is not None and boot_named(up.message) == "b1"
    p = pod("p", "1.2.3.4", gate="True", gate_boot=boot_named(up.message))
    assert decide(p, obs("b1"), None, complete=False, n_pools=3) is None  # repaired in place
    gone = decide(p, obs("b2"), None, complete=True, n_pools=3)  # complete: nothing rendered
    assert gone is not None and not gone.status and gone.reason == "EngineRestarted"


def test_the_boot_is_read_back_from_the_pod() -> None:
    long_id = "0123456789abcdef0123456789abcdef"
    up = decide(pod("p", "1.2.3.4"), obs(long_id), None, complete=True, n_pools=2)
    assert up is not None
    body = {
        "metadata": {"name": "p", "uid": "u"},
        "status": {"conditions": [{"type": GATE, "status": "True", "message": up.message}]},
    }
    assert ReplicaRef.from_pod(body).gate_boot == long_id[:12]
    body["status"]["conditions"][0]["status"] = "False"
    assert ReplicaRef.from_pod(body).gate_boot is None
    assert boot_named("materializing 3 declared pools") is None
    assert boot_named(None) is None


def test_unreachable() -> None:
    p = pod("p", "1.2.3.4", gate="True")
    assert decide(p, obs(reachable=False), Synced("b1", 0), False, 1) is None  # one bad poll
    fresh = pod("p", "1.2.3.4")
    want = decide(fresh, obs(reachable=False), None, False, 1)
    assert want is not None and want.reason == "EngineUnreachable"


def test_not_ready_container() -> None:
    want = decide(pod("p", "1.2.3.4", ready=False), None, None, False, 1)
    assert want is not None and want.reason == "EngineNotReady"


def test_must_drop_on_events() -> None:
    assert must_drop(pod("p", "x", gate="False", ready=False), None) is None
    assert must_drop(pod("p", "x", gate="True", ready=False), None).reason == "EngineNotReady"  # type: ignore[union-attr]
    assert (
        must_drop(pod("p", "x", gate="True", restarts=2), Synced("b", 1)).reason
        == "EngineRestarted"
    )  # type: ignore[union-attr]
    assert must_drop(pod("p", "x", gate="True", restarts=1), Synced("b", 1)) is None
