"""The OpenMP wait policy the engine sets before libllama loads (pure)."""

from __future__ import annotations

import pytest

from polykv_engine.boot import requested_threads
from polykv_engine.llama.cpus import CpuBudget
from polykv_engine.llama.omp import (
    OMP_POLICIES,
    OMP_POLICY_DEFAULT,
    apply_omp_policy,
    choose_policy,
    omp_wait,
)

ROOMY = CpuBudget(allowed=2, physical=2, quota=None)
LIMITED = CpuBudget(allowed=64, physical=32, quota=1.0)


def test_auto_spins_only_when_every_thread_has_a_cpu() -> None:
    assert OMP_POLICY_DEFAULT == "auto"
    env: dict[str, str] = {}
    choice = apply_omp_policy(env, threads=2, cpus=ROOMY)
    assert choice.policy == "spin" and "2 threads fit" in choice.reason
    assert env == {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "10000000"}
    assert omp_wait(env) == "active, spin count 10000000"
    env = {}
    choice = apply_omp_policy(env, threads=2, cpus=LIMITED)  # -t 2 under a 1-CPU limit
    assert choice.policy == "default" and "do not all fit" in choice.reason
    assert env == {}
    assert apply_omp_policy({}, threads=3, cpus=ROOMY).policy == "default"  # beyond the CPU set
    assert apply_omp_policy({}, cpus=LIMITED).policy == "spin"  # no -t: the budget's 1 thread


def test_each_named_policy_sets_its_variables_and_default_sets_none() -> None:
    for name in ("passive", "active"):
        env: dict[str, str] = {}
        assert apply_omp_policy(env, name, threads=8, cpus=ROOMY).policy == name
        assert env == {"OMP_WAIT_POLICY": name}
        assert omp_wait(env) == name
    env = {}
    apply_omp_policy(env, "default")
    assert env == {} and omp_wait(env).startswith("libgomp default")
    assert set(OMP_POLICIES) == {"spin", "passive", "active", "default"}


def test_the_policy_comes_from_the_environment_and_explicit_variables_win() -> None:
    env = {"POLYKV_OMP_WAIT_POLICY": "passive"}
    assert apply_omp_policy(env, cpus=ROOMY).policy == "passive"
    env = {"OMP_WAIT_POLICY": "passive"}
    choice = apply_omp_policy(env, "spin")
    assert env == {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10000000"}
    assert "OMP_WAIT_POLICY given win" in choice.reason and choice.policy == "custom"
    env = {"GOMP_SPINCOUNT": "5"}
    apply_omp_policy(env, "spin")
    assert env["GOMP_SPINCOUNT"] == "5"
    env = {"OMP_WAIT_POLICY": "passive"}  # what /props reports is what the runtime got
    assert apply_omp_policy(env, "default", cpus=ROOMY).policy == "passive"
    env = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "10000000"}
    assert apply_omp_policy(env, cpus=LIMITED, threads=2).policy == "spin"


def test_an_unknown_name_is_auto_and_says_so() -> None:
    choice = choose_policy("sleepy", 2, ROOMY)
    assert choice.policy == "spin" and "'sleepy' is not one of" in choice.reason


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["-m", "x.gguf"], {}, None),
        (["-m", "x.gguf", "-t", "4"], {}, 4),
        (["-t", "2", "-tb", "6"], {}, 6),
        (["--threads=3", "--port", "8080"], {}, 3),
        (["-t", "0"], {}, None),  # 0 means "the budget"
        (["-t", "many"], {}, None),  # the full parser reports it
        ([], {"LLAMA_ARG_THREADS": "5"}, 5),
        (["-t", "2"], {"LLAMA_ARG_THREADS": "5"}, 2),
        (["--timeout", "30", "--threads-batch", "4"], {}, 4),
    ],
)
def test_the_entry_point_reads_only_the_thread_flags(
    argv: list[str], env: dict[str, str], expected: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("LLAMA_ARG_THREADS", "LLAMA_ARG_THREADS_BATCH"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert requested_threads(argv) == expected


def test_engines_started_from_a_process_with_libllama_decide_their_own_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A test process that loaded libllama holds its own decision in os.environ; an engine it
    starts (other threads, maybe another cgroup) must not inherit it, unless asked to."""
    from pathlib import Path

    from polykv_engine.llama import omp
    from polykv_engine.testing import EngineProcess

    monkeypatch.setattr(omp, "set_by_decision", ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000000")
    monkeypatch.setenv("POLYKV_OMP_WAIT_POLICY", "passive")  # a user's choice travels
    env = EngineProcess(model=Path("m.gguf")).child_env()
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env
    assert env["POLYKV_OMP_WAIT_POLICY"] == "passive"
    given = EngineProcess(model=Path("m.gguf"), env={"OMP_WAIT_POLICY": "passive"}).child_env()
    assert given["OMP_WAIT_POLICY"] == "passive" and "GOMP_SPINCOUNT" not in given
    monkeypatch.setattr(omp, "set_by_decision", ())  # set by the user, not by a decision
    assert EngineProcess(model=Path("m.gguf")).child_env()["OMP_WAIT_POLICY"] == "active"
