"""Startup refusals: clear messages and exit code 2, never a half-started server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polykv_engine", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--no-kv-unified"], "pools need a unified KV cache"),
        (["-np", "0"], "--parallel must be >= 1"),
        (["--polykv-max-pools", "-1"], "--polykv-max-pools must be >= 0"),
        (["--polykv-park-mib", "-1"], "--polykv-park-mib must be >= 0"),
        (["--polykv-snapshot-mib", "0"], "--polykv-snapshot-mib must be >= 1"),
        (["--polykv-snapshot-mib", "99999999999"], "--polykv-snapshot-mib must be <= 16777216"),
        (["--polykv-session-save-mib", "-1"], "--polykv-session-save-mib must be >= 0"),
        (["--polykv-session-save-mib", "99999999999"], "--polykv-session-save-mib must be <="),
        (["--polykv-session-save-s", "-1"], "--polykv-session-save-s must be >= 0"),
        (["--polykv-session-save-s", "nan"], "--polykv-session-save-s must be <= 3600"),
        (["--polykv-session-save-s", "1e9"], "--polykv-session-save-s must be <= 3600"),
        (["--polykv-tps-interval-ms", "5"], "between 50 and 60000"),
        (["--polykv-stream-interval-ms", "-1"], "between 0 and 1000"),
        (["--polykv-stream-interval-ms", "5000"], "between 0 and 1000"),
        (["-fa", "sometimes"], "invalid choice"),
        (["--polykv-admission-ceiling", "prompt"], "invalid choice"),
        (["-fa", "off", "-ctv", "q8_0"], "needs flash attention"),
    ],
)
def test_bad_flags_exit_2_with_a_reason(test_model: Path, extra: list[str], needle: str) -> None:
    r = run_cli("-m", str(test_model), *extra)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_an_unknown_wait_policy_exits_2_before_loading_anything(test_model: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "polykv_engine", "-m", str(test_model)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "POLYKV_OMP_WAIT_POLICY": "sleepy"},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "POLYKV_OMP_WAIT_POLICY='sleepy' is not one of auto, spin" in r.stderr


def test_missing_model() -> None:
    r = run_cli("-m", "/nonexistent.gguf")
    assert r.returncode == 2 and "model file not found" in r.stderr
    r = run_cli()
    assert r.returncode == 2 and "a model is required" in r.stderr


def test_split_cache_without_pools_is_allowed(tmp_path: Path, test_model: Path) -> None:
    from polykv_engine.testing import running_engine

    with running_engine(test_model, ["--no-kv-unified", "--polykv-max-pools", "0", "-np", "2"],
                        tmp_path / "e.log") as eng:  # fmt: skip
        import httpx

        r = httpx.post(f"{eng.base_url}/completion", json={"prompt": "hi", "n_predict": 4})
        assert r.status_code == 200
        r = httpx.post(f"{eng.base_url}/polykv/pools", json={"prompt": "hi"})
        assert r.status_code == 501 and "--polykv-max-pools 0" in r.json()["error"]["message"]


def test_boot_warms_up_before_ready_and_no_warmup_skips_it(
    tmp_path: Path, test_model: Path
) -> None:
    from polykv_engine.testing import running_engine

    with running_engine(test_model, [], tmp_path / "warm.log") as eng:
        log = eng.log_tail(100)
        assert log.index("warm-up decode done") < log.index("model loaded")
    with running_engine(test_model, ["--no-warmup"], tmp_path / "cold.log") as eng:
        assert "warm-up" not in eng.log_tail(100)


def test_a_native_crash_leaves_a_stack_and_one_clear_line(tmp_path: Path, test_model: Path) -> None:
    """A fault inside llama.cpp has no Python exception: faulthandler reports the signal
    and where every thread was (the engine thread shows llama.cpp's caller)."""
    import signal

    from polykv_engine.testing import EngineProcess

    eng = EngineProcess(test_model, [], log_path=tmp_path / "crash.log")
    eng.start()
    assert eng.proc is not None
    eng.proc.send_signal(signal.SIGILL)  # what an unsupported CPU instruction raises
    assert eng.proc.wait(60) == -signal.SIGILL
    log = eng.log_tail(200)
    assert "Fatal Python error: Illegal instruction" in log
    assert 'File "' in log and "polykv" in log
