"""How ggml's OpenMP compute threads wait for the next graph (pure; no llama_cpp import, so
the engine and the benchmarks can set it before libllama and its OpenMP runtime load).

``POLYKV_OMP_WAIT_POLICY``:

- ``auto`` (the default): ``spin`` when every compute thread has a CPU of its own (the
  process's CPU set and CPU limit allow them all at once), else ``default``. Measured on a
  2-core EPYC: with 2 threads under a 1-CPU limit ``spin`` and ``default`` decode alike and
  ``passive`` 0.7-0.85x; with two busy processes beside the engine ``spin`` took a 2 s
  request past 60 s in half the runs (a thread spinning at a graph barrier for a sibling
  that is not running), ``default`` one run in four. (The thread count itself defaults to
  what fits, llama/cpus.py, so only an explicit ``-t`` lands here.)
- ``spin``: spin up to 10^7 rounds (tens of ms), then sleep. The gap between
  two decode steps is spun through; an idle engine sleeps. Measured on a 2-core EPYC with
  ``-t 2``: decode 2.5x ``passive`` at 1 and 8 streams, idle CPU 0.006 cores.
- ``passive``: sleep at once; every step pays a thread wake-up.
- ``active``: spin without end; as fast as ``spin``, but an idle engine burns threads - 1
  cores (1.006 cores measured 30 s after the last request).
- ``default``: libgomp's own (a short spin, then sleep; what llama-server runs with).

An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

from polykv_engine.llama.cpus import CpuBudget, budget

OMP_POLICIES: dict[str, dict[str, str]] = {
    "spin": {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "10000000"},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "active": {"OMP_WAIT_POLICY": "active"},
    "default": {},
}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
AUTO = "auto"
OMP_POLICY_DEFAULT = AUTO
OMP_POLICY_NAMES = (AUTO, *OMP_POLICIES)
ENV = "POLYKV_OMP_WAIT_POLICY"


@dataclass(frozen=True, slots=True)
class OmpChoice:
    policy: str  # one of OMP_POLICIES, or "custom" (OpenMP variables given that match none)
    reason: str  # why, for the boot log


def choose_policy(requested: str, threads: int, cpus: CpuBudget) -> OmpChoice:
    """``auto`` resolved against the CPUs ``threads`` compute threads will really get; any
    other name is taken as given (an unknown one falls back to ``auto``)."""
    if requested in OMP_POLICIES:
        return OmpChoice(requested, f"{ENV}={requested}")
    unknown = "" if requested == AUTO else f"{ENV}={requested!r} is not one of {OMP_POLICY_NAMES}; "
    if cpus.fits(threads):
        return OmpChoice("spin", f"{unknown}auto: {threads} threads fit ({cpus.describe()})")
    return OmpChoice(
        "default",
        f"{unknown}auto: {threads} threads do not all fit at once ({cpus.describe()})",
    )


def omp_settings(policy: str) -> dict[str, str]:
    """The OpenMP variables for a resolved policy name."""
    return dict(OMP_POLICIES[policy])


# What the process decided, for the boot log: the entry point decides once it knows -t, and
# the runtime's import decides (for library use) only if nothing did before.
decided: OmpChoice | None = None
# The variables that decision wrote into os.environ. A child process (an engine that a test
# or a benchmark starts) has its own threads and makes its own decision: launchers drop these.
set_by_decision: tuple[str, ...] = ()


def apply_omp_policy(
    environ: MutableMapping[str, str],
    policy: str | None = None,
    threads: int | None = None,
    cpus: CpuBudget | None = None,
) -> OmpChoice:
    """Resolves the policy and sets its variables where the environment does not set them
    already (an explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins)."""
    cpus = cpus or budget()
    choice = choose_policy(
        policy or environ.get(ENV, OMP_POLICY_DEFAULT), threads or cpus.threads, cpus
    )
    given = [var for var in OMP_VARS if var in environ]
    for var, value in omp_settings(choice.policy).items():
        environ.setdefault(var, value)
    if given:  # what the runtime will really do, named after the policy it matches
        now = {var: environ[var] for var in OMP_VARS if var in environ}
        policy = next((name for name, env in OMP_POLICIES.items() if env == now), "custom")
        return OmpChoice(policy, f"{choice.reason}; {', '.join(given)} given win")
    return choice


def decide_once(threads: int | None = None) -> OmpChoice:
    """Applies the policy to this process's environment, the first time only (libgomp reads
    it when it loads, so a later change would not take)."""
    global decided, set_by_decision
    if decided is None:
        before = {var for var in OMP_VARS if var in os.environ}
        decided = apply_omp_policy(os.environ, threads=threads)
        set_by_decision = tuple(v for v in OMP_VARS if v in os.environ and v not in before)
    return decided


def omp_wait(environ: MutableMapping[str, str] | None = None) -> str:
    """How the OpenMP threads wait, as the runtime was told (for the boot log)."""
    env = os.environ if environ is None else environ
    policy = env.get("OMP_WAIT_POLICY")
    if policy is None:
        return "libgomp default (a short spin, then sleep)"
    spins = env.get("GOMP_SPINCOUNT")
    return f"{policy}, spin count {spins}" if spins else policy
