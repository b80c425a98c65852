"""Pod facts, the metrics collector, the CLI wrapper and the settings.

Nothing here imports polykv_operator.main: importing it registers the handlers in kopf's
process-wide registry, which an in-process kopf runner in the same test session would pick up.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from polykv_operator import cli, metrics
from polykv_operator.config import Config, ConfigError
from polykv_operator.fleet import Fleet, Observation, ReplicaRef

from .builders import pod
from .fake_engine import FakeEngine, FakePool


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


def test_fleet_collector_exports_floor_pressure() -> None:
    fleet = Fleet()
    st = fleet.get("ns", "eng")
    eng = FakeEngine()
    pool = FakePool(1, "root", None, [1], 0)
    from polykv_operator.policies import engine_policy

    from .builders import policy

    pool.admission = engine_policy(policy("p", targetTpsPerSession=6).spec)
    eng.pools["root"] = pool
    st.pods["a"] = pod("a", "1.1.1.1", gate="True")
    st.replicas["a"] = Observation("a", "uid-a", "1.1.1.1", True, None, eng.listing())
    st.mean_active_tps = 12.0
    reg = CollectorRegistry()
    reg.register(metrics.FleetCollector(lambda: metrics.figures(fleet)))
    text = generate_latest(reg).decode()
    assert 'polykv_engine_floor_pressure{engine="eng",namespace="ns"} 0.5' in text
    assert 'polykv_engine_replicas_pools_ready{engine="eng",namespace="ns"} 1.0' in text
    assert "polykv_engine_mean_active_tps" in text


def test_reconcile_counter_is_registered() -> None:
    text = generate_latest(metrics.REGISTRY).decode()
    assert "polykv_operator_reconcile_total" in text
    assert "polykv_operator_engine_poll_seconds" in text


def test_cli_runs_kopf_with_the_handlers() -> None:
    assert cli.argv(["--all-namespaces"]) == [
        "kopf",
        "run",
        "--standalone",
        "--all-namespaces",
        "-m",
        "polykv_operator.main",
    ]
    assert "--standalone" not in cli.argv(["--peering", "x"])


def test_config_from_env(tmp_path) -> None:  # type: ignore[no-untyped-def]
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    cfg = Config.from_env(
        {"POLYKV_OPERATOR_MASTER_KEY_FILE": str(key), "POLYKV_OPERATOR_POLL_INTERVAL": "0.5"}
    )
    assert cfg.master_key == "s3cret" and cfg.poll_interval_s == 0.5
    assert cfg.metrics_port is None
    try:
        Config.from_env({}).require_master_key()
    except ConfigError as exc:
        assert "POLYKV_OPERATOR_MASTER_KEY" in str(exc)
    else:
        raise AssertionError("a missing master key must be refused")


def test_handler_ids_are_stable() -> None:
    """kopf keys handler progress (annotations) by handler id; renaming one orphans the
    progress of objects in flight. Checked in a child process: importing the handlers
    registers them in kopf's process-wide registry."""
    import json
    import subprocess
    import sys

    code = (
        "import json, kopf, polykv_operator.main\n"
        "reg = kopf.get_default_registry()\n"
        "ids = set()\n"
        "for r in (reg._changing, reg._spawning, reg._watching, reg._indexing):\n"
        "    for h in r.get_all_handlers():\n"
        "        ids.add(h.id)\n"
        "print(json.dumps(sorted(ids)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ids = set(json.loads(out.stdout))
    assert {
        "apply_engine",
        "engine_round",
        "forget_engine",
        "link_parent",
        "pool_status",
        "release_pool",
        "policy_status",
        "engine_pod_event",
        "engines_idx",
        "pools_idx",
        "policies_idx",
        "pods_idx",
    } <= ids, ids


def test_crash_point_kills_only_at_its_count() -> None:
    import subprocess
    import sys

    code = (
        "from polykv_operator.faults import crash_point\n"
        "crash_point('other'); crash_point('p'); print('alive', flush=True); crash_point('p')\n"
        "print('not reached')\n"
    )
    env = {"POLYKV_OPERATOR_CRASH_AT": "p:2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == -9 and out.stdout == "alive\n"
