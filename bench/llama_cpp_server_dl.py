"""Run llama-cpp-python's own server on a wheel built with per-CPU backend modules.

The portable wheel (GGML_BACKEND_DL) ships ggml's CPU backends as loadable modules that
nothing loads unless asked; llama-cpp-python's high-level server never asks, so the model
would fail to load ("no backends are loaded"). This loads them from the wheel's lib folder,
as the engine does at boot, then runs ``python -m llama_cpp.server`` with our arguments.
Runs in the baseline venv (llama_cpp only, no polykv).
"""

from __future__ import annotations

import ctypes
import re
import runpy
import sys
from pathlib import Path

import llama_cpp.llama_cpp as C  # loads libllama, and with it libggml


def main() -> None:
    maps = Path("/proc/self/maps").read_text()
    found = re.search(r"(\S*/libggml\.so[.0-9]*)\n", maps)
    lib_dir = Path(C.__file__).parent / "lib"
    ggml = ctypes.CDLL(found.group(1) if found else str(lib_dir / "libggml.so"))
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())
    sys.argv = ["llama_cpp.server", *sys.argv[1:]]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
