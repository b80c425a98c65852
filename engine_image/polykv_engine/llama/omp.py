"""How ggml's OpenMP compute threads wait for the next graph (pure; no llama_cpp import, so
the engine and the benchmarks can set it before libllama and its OpenMP runtime load).

``POLYKV_OMP_WAIT_POLICY``:

- ``spin`` (the default): spin up to 10^7 rounds (tens of ms), then sleep. The gap between
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

OMP_POLICIES: dict[str, dict[str, str]] = {
    "spin": {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "10000000"},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "active": {"OMP_WAIT_POLICY": "active"},
    "default": {},
}
OMP_POLICY_DEFAULT = "spin"
OMP_POLICY = os.environ.get("POLYKV_OMP_WAIT_POLICY", OMP_POLICY_DEFAULT)


def omp_settings(policy: str) -> dict[str, str]:
    """The OpenMP variables for a policy name; an unknown name gets the default's."""
    return dict(OMP_POLICIES.get(policy, OMP_POLICIES[OMP_POLICY_DEFAULT]))


def apply_omp_policy(environ: MutableMapping[str, str], policy: str = OMP_POLICY) -> None:
    """Sets the policy's variables where the environment does not set them already."""
    for var, value in omp_settings(policy).items():
        environ.setdefault(var, value)


def omp_wait(environ: MutableMapping[str, str] | None = None) -> str:
    """How the OpenMP threads wait, as the runtime was told (for the boot log)."""
    env = os.environ if environ is None else environ
    policy = env.get("OMP_WAIT_POLICY")
    if policy is None:
        return "libgomp default (a short spin, then sleep)"
    spins = env.get("GOMP_SPINCOUNT")
    return f"{policy}, spin count {spins}" if spins else policy
