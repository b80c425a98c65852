"""Which patched kernel paths run (scripts/patches/ggml-cpu-paths.patch): each is compiled into
the zen4 and haswell variants only, runs by default only on the CPU families it was measured to
win on in the variant loaded, and POLYKV_GGML_PATHS chooses them instead. The choice is made
once per process, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.report import cpuinfo_fields
from polykv_engine.llama.runtime import KERNEL_PATHS_ENV
from tests.engine.real.ggml_graphs import ggml

ALL = [
    "q4_1_rows",
    "q4_1_cols",
    "q4_K_cols",
    "q6_K_cols",
    "q5_1_cols",
    "fa_runs",
    "q5_0_cols",
    "q8_0_cols",
]
ZMM_ONLY = {"q5_0_cols", "q8_0_cols"}  # 512-bit code: compiled into zen4 alone
MEASURED_VARIANTS = ("zen4", "haswell")
PROBE = (
    "import json; from polykv_engine.llama.runtime import init_backend; b = init_backend(); "
    "print(json.dumps({'variant': b.cpu_variant, 'paths': list(b.kernel_paths)}))"
)


def probe(paths: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != KERNEL_PATHS_ENV}
    if paths is not None:
        env[KERNEL_PATHS_ENV] = paths
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )


def chosen(paths: str | None) -> tuple[str | None, list[str]]:
    done = probe(paths)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["variant"], out["paths"]


def cpu_identity() -> tuple[str, int]:
    """(vendor, family) as /proc/cpuinfo reports cpuid's."""
    fields = cpuinfo_fields()
    return fields.get("vendor_id", "?"), int(fields.get("cpu family", "-1"))


def compiled(variant: str | None) -> list[str]:
    """The paths the variant carries: zen4 all, haswell all but the 512-bit ones."""
    if variant not in MEASURED_VARIANTS:
        return []
    return ALL if variant == "zen4" else [p for p in ALL if p not in ZMM_ONLY]


def measured_to_win(variant: str | None, vendor: str, family: int) -> list[str]:
    """The table in docs/performance.md (kernel paths): in zen4, an Intel Xeon every path; in
    zen4 (Zen 4, Zen 5) and haswell (Zen 3), an AMD EPYC the Q4_1 column path and the
    attention path; any other CPU in those variants the attention path (ggml's own tiled
    kernel, on fewer rows); any other variant none."""
    if variant not in MEASURED_VARIANTS:
        return []
    if variant == "zen4" and (vendor, family) == ("GenuineIntel", 6):
        return ALL
    if (vendor, family) == ("AuthenticAMD", 0x19):
        return ["q4_1_cols", "fa_runs"]
    if variant == "zen4" and (vendor, family) == ("AuthenticAMD", 0x1A):
        return ["q4_1_cols", "fa_runs"]
    return ["fa_runs"]


@pytest.fixture(scope="module")
def variant() -> str | None:
    return ggml().backend.cpu_variant


def test_by_default_the_paths_measured_on_this_cpu_family_run(variant: str | None) -> None:
    assert chosen(None) == (variant, measured_to_win(variant, *cpu_identity())), cpu_identity()


def test_the_environment_chooses_the_paths(variant: str | None) -> None:
    assert chosen("none") == (variant, [])
    assert chosen("all") == (variant, compiled(variant))
    # Named ones in any order and spacing; the report keeps the table's order.
    assert chosen(" q8_0_cols, q6_K_cols,q4_1_rows ") == (
        variant,
        [p for p in ["q4_1_rows", "q6_K_cols", "q8_0_cols"] if p in compiled(variant)],
    )


def test_an_unknown_path_name_is_refused_at_start() -> None:
    done = probe("q4_1_cols,q4_0_cols")
    assert done.returncode != 0
    assert f"{KERNEL_PATHS_ENV}: unknown kernel path(s) q4_0_cols" in done.stderr
