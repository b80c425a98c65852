"""The OpenMP wait policy the engine sets before libllama loads (pure)."""

from __future__ import annotations

from polykv_engine.llama.omp import (
    OMP_POLICIES,
    OMP_POLICY_DEFAULT,
    apply_omp_policy,
    omp_settings,
    omp_wait,
)


def test_the_default_spins_a_bounded_while_then_sleeps() -> None:
    assert OMP_POLICY_DEFAULT == "spin"
    env: dict[str, str] = {}
    apply_omp_policy(env, "spin")
    assert env == {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "10000000"}
    assert omp_wait(env) == "active, spin count 10000000"


def test_each_policy_sets_its_variables_and_default_sets_none() -> None:
    for name in ("passive", "active"):
        env: dict[str, str] = {}
        apply_omp_policy(env, name)
        assert env == {"OMP_WAIT_POLICY": name}
        assert omp_wait(env) == name
    env = {}
    apply_omp_policy(env, "default")
    assert env == {} and omp_wait(env).startswith("libgomp default")
    assert set(OMP_POLICIES) == {"spin", "passive", "active", "default"}


def test_an_explicit_environment_wins_and_an_unknown_name_gets_the_default() -> None:
    env = {"OMP_WAIT_POLICY": "passive"}
    apply_omp_policy(env, "spin")
    assert env == {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10000000"}
    env = {"GOMP_SPINCOUNT": "5"}
    apply_omp_policy(env, "spin")
    assert env["GOMP_SPINCOUNT"] == "5"
    assert omp_settings("sleepy") == omp_settings(OMP_POLICY_DEFAULT)
