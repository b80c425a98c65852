"""Run one ggml operation on the CPU backend the engine itself loads, straight from Python.

The kernel tests beside this module compare our patched ggml kernels (scripts/patches/) with
numpy references that share none of their code. To reach a kernel without a model around it,
this module builds a one-op ggml graph through ggml's C API (ctypes over the wheel's
libggml-base and libggml) and computes it on the CPU device of the backend registry, i.e. on
the per-CPU module (libggml-cpu-<variant>.so) that ``init_backend`` picked for this machine,
the same code llama.cpp runs.

Tensors live in a plain ggml context (no backend buffer): the CPU backend computes on such
tensors directly, and without a buffer no weight is repacked, so a matrix product goes to
ggml's generic vec-dot path, which is the path the Q4_1 patch changes.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from polykv_engine.llama.runtime import KERNEL_PATHS_ENV, BackendInfo, init_backend

# ggml_type values (ggml.h) of the types these tests use.
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_Q4_1 = 3
GGML_TYPE_Q5_1 = 7
GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_STATUS_SUCCESS = 0

_NUMPY_TYPES = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16}


class TensorHead(ctypes.Structure):
    """The leading fields of ggml.h's struct ggml_tensor, enough to check what was built."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
    ]


class InitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


def mapped_library(pattern: str) -> Path:
    """The file of a shared library already mapped into this process (the wheel ships several
    copies of libggml under different names, and only the mapped one holds the registry)."""
    found = re.search(rf"(\S*/{pattern})\n", Path("/proc/self/maps").read_text())
    assert found, f"no library matching {pattern} is loaded in this process"
    return Path(found.group(1))


@dataclass(frozen=True)
class Ggml:
    base: ctypes.CDLL  # libggml-base: contexts, tensors, graphs
    registry: ctypes.CDLL  # libggml: the backend registry that llama.cpp uses
    backend: BackendInfo  # what the engine reports about the loaded CPU module


def _declare(lib: ctypes.CDLL, name: str, restype: object, *argtypes: object) -> None:
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)


@cache
def ggml() -> Ggml:
    """ggml's libraries as llama.cpp loaded them, with the functions used here declared."""
    info = init_backend()  # loads the best CPU module for this machine, as the engine does
    base = ctypes.CDLL(str(mapped_library(r"libggml-base\.so[.0-9]*")))
    registry = ctypes.CDLL(str(mapped_library(r"libggml\.so[.0-9]*")))
    p, i64, sz, f32, i32 = (
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_size_t,
        ctypes.c_float,
        ctypes.c_int,
    )
    _declare(base, "ggml_init", p, InitParams)
    _declare(base, "ggml_free", None, p)
    _declare(base, "ggml_tensor_overhead", sz)
    _declare(base, "ggml_graph_overhead", sz)
    _declare(base, "ggml_new_tensor", p, p, i32, i32, ctypes.POINTER(i64))
    _declare(base, "ggml_mul_mat", p, p, p, p)
    _declare(base, "ggml_flash_attn_ext", p, p, p, p, p, p, f32, f32, f32)
    _declare(base, "ggml_new_graph", p, p)
    _declare(base, "ggml_build_forward_expand", None, p, p)
    _declare(base, "ggml_get_data", p, p)
    _declare(base, "ggml_nbytes", sz, p)
    _declare(base, "ggml_type_name", ctypes.c_char_p, i32)
    _declare(base, "ggml_op_name", ctypes.c_char_p, i32)
    _declare(registry, "ggml_backend_dev_by_type", p, i32)
    _declare(registry, "ggml_backend_dev_init", p, p, ctypes.c_char_p)
    _declare(registry, "ggml_backend_dev_backend_reg", p, p)
    _declare(registry, "ggml_backend_reg_get_proc_address", p, p, ctypes.c_char_p)
    _declare(registry, "ggml_backend_graph_compute", i32, p, p)
    _declare(registry, "ggml_backend_free", None, p)
    return Ggml(base, registry, info)


@contextmanager
def cpu_backend(n_threads: int) -> Iterator[int]:
    """A CPU backend of the registry llama.cpp uses, computing on n_threads threads."""
    g = ggml()
    dev = g.registry.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    assert dev, "the ggml registry has no CPU device"
    backend = g.registry.ggml_backend_dev_init(dev, None)
    assert backend, "the CPU device would not start a backend"
    try:
        reg = g.registry.ggml_backend_dev_backend_reg(dev)
        addr = g.registry.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_set_n_threads")
        assert addr, "the CPU backend exports no ggml_backend_set_n_threads"
        set_threads = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int)(addr)
        set_threads(backend, n_threads)
        yield backend
    finally:
        g.registry.ggml_backend_free(backend)


class Graph:
    """One ggml context holding a few tensors and a graph that computes one of them."""

    def __init__(self, data_bytes: int) -> None:
        self.g = ggml()
        # Room for the tensors' data and headers, the graph, and ggml's alignment padding.
        size = data_bytes + 64 * (self.g.base.ggml_tensor_overhead() + 256)
        size += self.g.base.ggml_graph_overhead()
        self.ctx = self.g.base.ggml_init(InitParams(size, None, False))
        assert self.ctx, f"ggml_init failed for {size} bytes"

    def close(self) -> None:
        self.g.base.ggml_free(self.ctx)

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def tensor(self, ggml_type: int, ne: Sequence[int], data: np.ndarray) -> int:
        """A new tensor of ggml_type with dimensions ne (ggml order: ne[0] varies fastest),
        filled with data's bytes (whose size must match exactly)."""
        dims = (ctypes.c_int64 * len(ne))(*ne)
        t = self.g.base.ggml_new_tensor(self.ctx, ggml_type, len(ne), dims)
        assert t, "out of ggml context memory"
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        nbytes = self.g.base.ggml_nbytes(t)
        assert raw.size == nbytes, f"{raw.size} bytes of data for a tensor of {nbytes}"
        ctypes.memmove(self.g.base.ggml_get_data(t), raw.ctypes.data, nbytes)
        return int(t)

    def head(self, t: int) -> TensorHead:
        return TensorHead.from_address(t)

    def type_name(self, t: int) -> str:
        return str(self.g.base.ggml_type_name(self.head(t).type).decode())

    def op_name(self, t: int) -> str:
        return str(self.g.base.ggml_op_name(self.head(t).op).decode())

    def compute(self, out: int, n_threads: int) -> np.ndarray:
        """Compute `out` on the CPU backend; its data as a numpy array in ggml's dimension
        order reversed (numpy's row-major view of ne[3], ne[2], ne[1], ne[0])."""
        graph = self.g.base.ggml_new_graph(self.ctx)
        self.g.base.ggml_build_forward_expand(graph, out)
        with cpu_backend(n_threads) as backend:
            status = self.g.registry.ggml_backend_graph_compute(backend, graph)
        assert status == GGML_STATUS_SUCCESS, f"ggml_backend_graph_compute returned {status}"
        head = self.head(out)
        dtype = np.dtype(_NUMPY_TYPES[head.type])
        shape = tuple(reversed([int(n) for n in head.ne]))
        raw = ctypes.string_at(self.g.base.ggml_get_data(out), int(np.prod(shape)) * dtype.itemsize)
        result: np.ndarray = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        return result


def _choose_paths(paths: str) -> None:
    os.environ[KERNEL_PATHS_ENV] = paths


def loaded_paths() -> tuple[str, ...]:
    """The kernel paths that run in this process."""
    return tuple(ggml().backend.kernel_paths)


@cache
def paths_process(paths: str) -> ProcessPoolExecutor:
    """A child process whose ggml runs only the kernel paths named (POLYKV_GGML_PATHS: ggml
    decides once per process), to compute there what a path replaces here: a module-level
    function submitted to it runs on the child's ggml."""
    return ProcessPoolExecutor(
        1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_choose_paths,
        initargs=(paths,),
    )


def cpu_module() -> Path:
    """The per-CPU backend module llama.cpp loaded, failing (with the reason) when there is
    none: a build without GGML_BACKEND_DL would not be the wheel these tests are about."""
    info = ggml().backend
    assert info.cpu_library, "no per-CPU ggml module is loaded (not the portable wheel?)"
    return Path(info.cpu_library)


def require_avx2() -> None:
    """Both patches are x86 AVX2 code (the Q4_1 kernels sit under #if __AVX2__): on a CPU
    without AVX2 ggml loads a module without them, and there is nothing here to test."""
    features = ggml().backend.features
    if features.get("AVX2") != "1":
        pytest.skip(
            f"the loaded CPU module has no AVX2 (features: {features}); the patched "
            "kernels are compiled out there"
        )


def binary_symbols(binary: Path) -> set[str]:
    """Every symbol name in the binary's symbol tables (static and dynamic)."""
    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed to inspect the loaded CPU module"
    names: set[str] = set()
    for flags in ([], ["-D"]):
        run = subprocess.run([nm, *flags, str(binary)], capture_output=True, text=True)
        names |= {line.split()[-1] for line in run.stdout.splitlines() if line.strip()}
    return names


def disassembly(binary: Path) -> str:
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils) is needed to inspect the loaded CPU module"
    return subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(binary)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
