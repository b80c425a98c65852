"""The process around the handlers: the CLI wrapper, the settings, handler ids, crash points.

Nothing here imports polykv_operator.main in this process: importing it registers the
handlers in kopf's process-wide registry, which an in-process kopf runner in the same test
session would pick up.
"""

from __future__ import annotations

import pytest

from polykv_operator import cli
from polykv_operator.config import Config, ConfigError


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
    assert "--standalone" not in cli.argv(["--all-namespaces", "--peering=polykv"])


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
        "engine_loop",
        "forget_engine",
        "link_parent",
        "pool_labels/metadata.labels",
        "policy_event",
        "counted_event",
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
        "crash_point('polled'); crash_point('rendered'); print('alive', flush=True); "
        "crash_point('rendered')\n"
        "print('not reached')\n"
    )
    env = {"POLYKV_OPERATOR_CRASH_AT": "rendered:2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == -9 and out.stdout == "alive\n"


def test_autoscaling_settings() -> None:
    env = {
        "POLYKV_OPERATOR_MASTER_KEY": "k",
        "POLYKV_OPERATOR_AUTOSCALE_PORT": "8082",
        "POLYKV_OPERATOR_EXTERNAL_METRICS_PORT": "6443",
        "POLYKV_OPERATOR_EXTERNAL_METRICS_CERT": "/tls/tls.crt",
        "POLYKV_OPERATOR_EXTERNAL_METRICS_KEY": "/tls/tls.key",
        "POLYKV_OPERATOR_EXTERNAL_METRICS_SERVICE": "polykv-system/metrics",
    }
    cfg = Config.from_env(env)
    cfg.check()
    assert (cfg.autoscale_port, cfg.external_metrics_port) == (8082, 6443)
    assert str(cfg.external_metrics_cert) == "/tls/tls.crt"
    off = Config.from_env({"POLYKV_OPERATOR_MASTER_KEY": "k"})
    off.check()
    assert off.autoscale_port is None and off.external_metrics_port is None


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"POLYKV_OPERATOR_AUTOSCALE_PORT": "http"}, "POLYKV_OPERATOR_AUTOSCALE_PORT"),
        ({"POLYKV_OPERATOR_EXTERNAL_METRICS_PORT": "70000"}, "1-65535"),
        ({"POLYKV_OPERATOR_EXTERNAL_METRICS_CERT": ""}, "EXTERNAL_METRICS_CERT"),
        ({"POLYKV_OPERATOR_EXTERNAL_METRICS_SERVICE": "metrics"}, "namespace/name"),
        ({"POLYKV_OPERATOR_EXTERNAL_METRICS_SERVICE": "a/b/c"}, "namespace/name"),
    ],
)
def test_autoscaling_settings_that_cannot_work_are_refused(
    change: dict[str, str], needle: str
) -> None:
    env = {
        "POLYKV_OPERATOR_MASTER_KEY": "k",
        "POLYKV_OPERATOR_EXTERNAL_METRICS_PORT": "6443",
        "POLYKV_OPERATOR_EXTERNAL_METRICS_CERT": "/tls/tls.crt",
        "POLYKV_OPERATOR_EXTERNAL_METRICS_KEY": "/tls/tls.key",
        **change,
    }
    with pytest.raises(ConfigError, match=needle):
        Config.from_env(env).check()
