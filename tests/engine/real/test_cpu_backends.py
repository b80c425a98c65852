"""Quantized models on the portable llama.cpp build: every common weight format serves many
requests on every thread, the CPU backend picked at run time is reported, and no AMX code
ships (ggml's AMX path dies with SIGILL on AMX Xeons whose threads lack the permission)."""

from __future__ import annotations

import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import llama_cpp
import pytest

from polykv_engine.llama.runtime import init_backend
from polykv_engine.testing import EngineProcess
from tests.conftest import real_model_path

pytestmark = pytest.mark.real_model

LIB = Path(llama_cpp.__file__).resolve().parent / "lib"
REPO = Path(__file__).resolve().parents[3]
QUANTIZED = [
    "smollm2-135m-instruct-q4_1",
    "smollm2-135m-instruct-q8_0",
    "smollm2-135m-instruct-q4_k_m",
    "smollm2-135m-instruct-q5_1",
    "gemma-3-270m-q4_k_m",
]


def shipped_patches() -> list[str]:
    return sorted(p.stem for p in (REPO / "scripts" / "patches").glob("*.patch"))


def test_the_installed_llama_cpp_carries_every_patch_of_this_checkout() -> None:
    """scripts/build-llama-wheel.sh keys its cache on the patches; a venv whose wheel predates
    one (or a llama-cpp-python from elsewhere) would benchmark the wrong kernels."""
    manifest = json.loads((LIB.parent / "polykv_build.json").read_text())
    assert manifest["patches"] == shipped_patches() != []
    assert manifest["dropped_variants"] == ["sapphirerapids"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_model_serves_many_requests_on_every_thread(name: str, tmp_path: Path) -> None:
    # -t 0: every core this process may use decodes, the configuration that crashed on AMX
    # hardware.
    eng = EngineProcess(
        real_model_path(name), ["-np", "4", "-c", "4096", "-t", "0"], log_path=tmp_path / "e.log"
    )
    eng.start(timeout=180)
    try:
        with httpx.Client(base_url=eng.base_url, timeout=120) as api:
            backend = api.get("/props").json()["polykv"]["cpu_backend"]
            assert backend["variant"], backend  # a per-CPU module was picked at run time
            assert not backend["amx"] and "AMX_INT8" not in backend["features"]
            assert backend["patches"] == shipped_patches()
            # The gate's choice for this CPU, as this test process's own ggml made it.
            assert backend["kernel_paths"] == list(init_backend().kernel_paths)
            print(f"{name}: CPU backend {backend['variant']}, repack={backend['repack']}")

            def one(i: int) -> int:
                r = api.post(
                    "/completion",
                    json={"prompt": f"Question {i}: what is {i} + {i}?", "n_predict": 16},
                )
                return r.status_code

            with ThreadPoolExecutor(4) as pool:
                codes = list(pool.map(one, range(24)))
            assert codes == [200] * 24
            assert eng.proc is not None and eng.proc.poll() is None
        assert "warm-up decode done" in eng.log_tail(200)
    finally:
        assert eng.stop() == 0


def has_amx_code(binary: Path) -> bool:
    """Every AMX instruction names a tile register (%tmm0-7) or (re)configures the tiles."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.fail("objdump (binutils) is needed to inspect the shipped CPU backends")
    asm = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(binary)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return any(word in asm for word in ("%tmm", "ldtilecfg", "tilerelease"))


def test_the_amx_detector_finds_amx_code(tmp_path: Path) -> None:
    src = tmp_path / "amx.c"
    src.write_text("#include <immintrin.h>\nvoid f(void) { _tile_zero(0); _tile_release(); }\n")
    obj = tmp_path / "amx.o"
    subprocess.run(["gcc", "-O2", "-mamx-tile", "-c", str(src), "-o", str(obj)], check=True)
    assert has_amx_code(obj)


def test_the_wheel_ships_per_cpu_backends_without_amx_code() -> None:
    modules = sorted(LIB.glob("libggml-cpu-*.so"))
    names = {m.name.removeprefix("libggml-cpu-").removesuffix(".so") for m in modules}
    assert {"x64", "haswell", "skylakex", "zen4"} <= names, names
    assert "sapphirerapids" not in names
    for module in modules:
        assert not has_amx_code(module), f"AMX code in {module.name}"
