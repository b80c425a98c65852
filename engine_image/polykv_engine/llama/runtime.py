"""The only module that touches llama.cpp: model, context, batch, KV memory and samplers.

Everything here is a thin, RAII-style wrapper over ``llama_cpp.llama_cpp`` (the ctypes layer;
the high-level ``Llama`` class is never used). Rules this module enforces because llama.cpp
would otherwise abort the whole process with a GGML_ASSERT:

* a batch never holds more tokens than ``llama_n_batch(ctx)`` (the effective n_batch is
  ``min(n_ctx, n_batch)``);
* sequence ids are checked against ``n_seq_max`` before any memory call (with a unified
  cache ``seq_cp``/``seq_rm`` accept out-of-range ids silently);
* a non-zero ``llama_decode`` result is returned to the caller (1 = no KV slot, recoverable)
  or raised (anything else).

Only the engine thread calls the mutating methods. Tokenization reads the vocabulary only and
is safe from any thread, as in llama-server.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The OpenMP wait policy must be in the environment before libllama (and its OpenMP runtime)
# loads: the imports below come after this on purpose.
# ruff: noqa: E402
from polykv_engine.llama.cpus import budget
from polykv_engine.llama.omp import decide_once, omp_wait

# The entry point decides first, knowing -t; a library user gets the budget's thread count.
decide_once()

import llama_cpp
import llama_cpp.llama_cpp as C
import numpy as np

from polykv_engine.llama.grammar import CompiledGrammar, Grammar, layout_ok, parse_stacks
from polykv_engine.llama.sampling import SamplingParams

log = logging.getLogger("polykv.llama")

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line.
_LOG_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_last_level = logging.DEBUG
# With LLAMA_KV_CACHE_DEBUG=1, find_slot logs "used = N": the only public view of used cells.
_USED_RE = re.compile(r"used = +(\d+)")
_used_capture: list[int] | None = None


@C.llama_log_callback  # type: ignore[untyped-decorator]
def _route_llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp is chatty at INFO (every model key at load): that goes to DEBUG.
    global _last_level
    py_level = _last_level if level == 5 else _LOG_LEVELS.get(level, logging.DEBUG)
    _last_level = py_level
    message = text.decode("utf-8", "replace").rstrip()
    if _used_capture is not None and "find_slot" in message:
        found = _USED_RE.search(message)
        if found:
            _used_capture.append(int(found.group(1)))
    if message and log.isEnabledFor(py_level):
        log.log(py_level, "%s", message)


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What llama.cpp will run on, from the loaded backends' own reports."""

    cpu_variant: str | None  # e.g. "haswell": the per-CPU build ggml picked for this machine
    cpu_library: str | None
    features: dict[str, str]  # the CPU backend's features (AVX2 = 1, ...)
    extra_buffer_types: tuple[str, ...]  # e.g. CPU_REPACK; an "AMX" entry means AMX kernels
    system_info: str  # llama_print_system_info(), verbatim
    patches: tuple[str, ...] = ()  # PolyKV's patches to the vendored llama.cpp in this build
    kernel_paths: tuple[str, ...] = ()  # the patched kernel paths that run on this CPU

    @property
    def amx(self) -> bool:
        """True when any AMX code path is present in the loaded CPU backend."""
        return any(k.startswith("AMX") for k in self.features) or any(
            "AMX" in b for b in self.extra_buffer_types
        )


_backend: BackendInfo | None = None


def _lib_dir() -> Path:
    return Path(C.__file__).resolve().parent / "lib"


def build_patches() -> tuple[str, ...]:
    """The patches scripts/build-llama-wheel.sh applied (its manifest in the wheel); none for a
    llama-cpp-python built elsewhere."""
    manifest = Path(C.__file__).resolve().parent / "polykv_build.json"
    try:
        return tuple(json.loads(manifest.read_text()).get("patches", ()))
    except (OSError, ValueError, AttributeError):
        return ()


def _mapped(pattern: str) -> str | None:
    """The path of a shared library mapped into this process, by file-name pattern."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found = re.search(rf"(\S*/{pattern})\n", maps)
    return found.group(1) if found else None


def _ggml() -> ctypes.CDLL:
    # The very libggml that libllama is linked against: the wheel holds copies under several
    # names (libggml.so, .so.0, ...), and each copy has a backend registry of its own.
    path = _mapped(r"libggml\.so[.0-9]*") or str(_lib_dir() / "libggml.so.0")
    lib = ctypes.CDLL(path)
    lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_load_all_from_path.restype = None
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buft_name.restype = ctypes.c_char_p
    return lib


# Which patched kernel paths run (scripts/patches/ggml-cpu-paths.patch): by default those
# measured to win on this CPU family, or exactly these ("all", "none" or names, comma-separated).
KERNEL_PATHS_ENV = "POLYKV_GGML_PATHS"


def _path_names(text: str) -> list[str]:
    return [name for name in re.split(r"[ ,]+", text) if name]


def _kernel_paths(library: str | None) -> tuple[str, ...]:
    """The patched kernel paths that run in this process, as the CPU module chose them (once,
    at its first product); a POLYKV_GGML_PATHS name it does not know is an error here, before
    any product runs."""
    requested = os.environ.get(KERNEL_PATHS_ENV)
    gate = ctypes.CDLL(library) if library is not None else None
    if gate is None or not hasattr(gate, "polykv_ggml_paths"):
        if requested is not None:
            raise LlamaError(f"{KERNEL_PATHS_ENV} is set, but this llama.cpp build has no gate")
        return ()
    for name in ("polykv_ggml_paths", "polykv_ggml_paths_known"):
        getattr(gate, name).restype = ctypes.c_char_p
        getattr(gate, name).argtypes = []
    known = _path_names(gate.polykv_ggml_paths_known().decode())
    if requested is not None:
        unknown = sorted(set(_path_names(requested)) - set(known) - {"all", "none"})
        if unknown:
            raise LlamaError(
                f"{KERNEL_PATHS_ENV}: unknown kernel path(s) {', '.join(unknown)}; "
                f"known: all, none, {', '.join(known)}"
            )
    return tuple(_path_names(gate.polykv_ggml_paths().decode()))


def _extra_buffer_types(lib: ctypes.CDLL) -> tuple[str, ...]:
    dev = lib.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        return ()
    reg = lib.ggml_backend_dev_backend_reg(dev)
    addr = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not addr:
        return ()
    get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(addr)
    bufts = get(dev)
    names = []
    i = 0
    while bufts and bufts[i]:
        names.append(lib.ggml_backend_buft_name(bufts[i]).decode())
        i += 1
    return tuple(names)


def init_backend() -> BackendInfo:
    """Load ggml's backends once: with per-CPU builds (GGML_BACKEND_DL) the best module for
    this CPU is chosen at run time from the wheel's lib folder (or POLYKV_GGML_BACKEND_DIR)."""
    global _backend
    if _backend is not None:
        return _backend
    C.llama_log_set(_route_llama_log, ctypes.c_void_p(0))
    lib = _ggml()
    override = os.environ.get("POLYKV_GGML_BACKEND_DIR")
    for folder in [Path(override)] if override else [_lib_dir()]:
        if any(folder.glob("libggml-*.so")):
            lib.ggml_backend_load_all_from_path(str(folder).encode())
    C.llama_backend_init()
    if lib.ggml_backend_reg_count() == 0:
        raise LlamaError(
            f"no ggml backend could be loaded from {override or _lib_dir()}: the "
            "llama-cpp-python build is incomplete (scripts/build-llama-wheel.sh)"
        )
    info = C.llama_print_system_info().decode("utf-8", "replace")
    cpu = re.search(r"CPU : (.*?)(?:\| [A-Z]+ : |$)", info)
    features = dict(re.findall(r"(\w+) = (\w+)", cpu.group(1))) if cpu else {}
    library = _mapped(r"libggml-cpu[^/\s]*\.so")  # ggml keeps only the best module loaded
    variant = None
    if library is not None:
        tag = re.search(r"libggml-cpu-([\w.]+?)\.so", library)
        variant = tag.group(1) if tag else "native"
    _backend = BackendInfo(
        variant,
        library,
        features,
        _extra_buffer_types(lib),
        info,
        build_patches(),
        _kernel_paths(library),
    )
    log.info(
        "ggml CPU backend: %s (%s); features: %s; extra buffer types: %s; patches: %s; "
        "kernel paths: %s; OpenMP wait: %s",
        variant or "built in",
        library or "linked into libggml",
        " ".join(k for k, v in features.items() if v == "1") or "none",
        ", ".join(_backend.extra_buffer_types) or "none",
        ", ".join(_backend.patches) or "none",
        ", ".join(_backend.kernel_paths) or "none",
        omp_wait(),
    )
    choice = decide_once()
    log.info("OpenMP wait policy: %s (%s)", choice.policy, choice.reason)
    return _backend


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first


class LlamaError(RuntimeError):
    """llama.cpp refused an operation (bad model file, failed decode, ...)."""


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    model_path: Path
    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_threads: int = 0  # 0: the cores this process may use (llama/cpus.py)
    n_threads_batch: int = 0
    n_gpu_layers: int = 0
    kv_unified: bool = True
    kv_debug: bool = False  # let measure_used_cells read llama.cpp's own used-cell count
    flash_attn: str = "auto"  # on | off | auto (auto: on for CPU layers, else llama.cpp decides)
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    repack: bool = True  # weights repacked into the CPU's fastest layout (--no-repack: off)
    swa_full: bool = False  # full-size sliding-window cache (llama-server's --swa-full)
    # Sequences added after n_seq_max on a sliding-window model only (pools' guards, see
    # kv.cache): other models would pay for sequences they never use.
    guard_seqs: int = 0


# KV cache element types and their ggml type ids.
CACHE_TYPES: dict[str, int] = {
    "f32": int(C.GGML_TYPE_F32),
    "f16": int(C.GGML_TYPE_F16),
    "q8_0": int(C.GGML_TYPE_Q8_0),
}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    path: str
    description: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_params: int
    size_bytes: int
    is_recurrent: bool
    is_hybrid: bool
    n_swa: int  # sliding-window size of the SWA layers; 0 = full attention everywhere
    chat_template: str | None
    architecture: str  # the GGUF's general.architecture (llama, gemma3, ...)
    bos: int
    eos: int
    add_bos: bool


class Batch:
    """A reusable ``llama_batch``: each token belongs to one sequence, or to two (a pool's
    cells that its guard sequence holds as well, see ``kv.cache``)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._raw = C.llama_batch_init(capacity, 0, 2)
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq_id: int, logits: bool, also: int | None = None) -> int:
        """Append a token (of ``seq_id``, and of ``also`` when given); returns its index
        (the ``idx`` for sampling when logits=True)."""
        i = self.n
        if i >= self.capacity:
            raise LlamaError(f"batch overflow: capacity {self.capacity}")
        raw = self._raw
        raw.token[i] = token
        raw.pos[i] = pos
        raw.seq_id[i][0] = seq_id
        if also is None:
            raw.n_seq_id[i] = 1
        else:
            raw.n_seq_id[i] = 2
            raw.seq_id[i][1] = also
        raw.logits[i] = 1 if logits else 0
        self.n = i + 1
        return i

    def add_span(
        self,
        tokens: Sequence[int],
        pos0: int,
        seq_id: int,
        logits_last: bool,
        also: int | None = None,
    ) -> int:
        """Append consecutive tokens of one sequence; returns the last token's index."""
        for k, tok in enumerate(tokens):
            self.add(tok, pos0 + k, seq_id, logits_last and k == len(tokens) - 1, also)
        return self.n - 1

    def free(self) -> None:
        if self._raw is not None:
            C.llama_batch_free(self._raw)
            self._raw = None


class Sampler:
    """A llama.cpp sampler chain for one request; free it when the request ends.

    A grammar, when given, comes first: it removes every token that cannot continue a valid
    output, and the usual samplers choose among the rest (llama.cpp's chain order). It
    comes compiled (``CompiledGrammar``, built off the engine thread); the chain takes it
    over. ``count_stacks``: whether ``grammar_stacks`` may read llama.cpp's parse stacks."""

    def __init__(
        self,
        params: SamplingParams,
        n_vocab: int,
        grammar: CompiledGrammar | None = None,
        count_stacks: bool = False,
        banned: Sequence[int] = (),
    ) -> None:
        if (grammar is None) != (params.grammar is None):
            raise ValueError("a grammar comes compiled, off the engine thread, or not at all")
        # Tokens never sampled (ignore_eos bans the end-of-generation tokens, as llama-server
        # does with a -inf logit bias: decoding past one is not enough, the text would hold it).
        self._banned = np.array(sorted(set(banned)), dtype=np.int64)
        # Plain greedy is an argmax over the logits: llama_sampler_sample would first copy
        # every logit into a candidate array (34 us at a 49k vocabulary, 4 us for the argmax;
        # both take the first of equal maxima).
        self._logits_type: Any = None
        if params.greedy and params.grammar is None and not params.has_penalties:
            self._logits_type = ctypes.c_float * n_vocab
        cparams = C.llama_sampler_chain_default_params()
        chain = C.llama_sampler_chain_init(cparams)
        if not chain:
            raise LlamaError("llama_sampler_chain_init failed")
        self._chain: ctypes.c_void_p | None = chain
        self._penalties: ctypes.c_void_p | None = None
        self._grammar: Any = None
        add = C.llama_sampler_chain_add
        if len(self._banned):
            bias = (C.llama_logit_bias * len(self._banned))(
                *(C.llama_logit_bias(int(t), float("-inf")) for t in self._banned)
            )
            add(chain, C.llama_sampler_init_logit_bias(n_vocab, len(self._banned), bias))
        if grammar is not None:
            self._grammar = grammar.take()
            add(chain, self._grammar)
            if not count_stacks:
                self._grammar = None
        if params.has_penalties:
            self._penalties = C.llama_sampler_init_penalties(
                n_vocab,
                params.repeat_last_n,
                params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
            add(chain, self._penalties)
        if params.greedy:
            add(chain, C.llama_sampler_init_greedy())
        else:
            add(chain, C.llama_sampler_init_top_k(params.top_k))
            add(chain, C.llama_sampler_init_top_p(params.top_p, 1))
            add(chain, C.llama_sampler_init_min_p(params.min_p, 1))
            add(chain, C.llama_sampler_init_temp(params.temperature))
            add(chain, C.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))

    def accept_prompt(self, token: int) -> None:
        """Feed a prompt token to the repetition penalties (never to the grammar, which
        constrains the output only)."""
        if self._penalties is not None:
            C.llama_sampler_accept(self._penalties, token)

    def sample(self, ctx: ctypes.c_void_p, idx: int) -> int:
        if self._logits_type is not None:
            ptr = C.llama_get_logits_ith(ctx, idx)
            if not ptr:
                raise LlamaError(f"no logits at batch index {idx}")
            row = ctypes.cast(ptr, ctypes.POINTER(self._logits_type)).contents
            logits = np.frombuffer(row, dtype=np.float32)
            best = int(logits.argmax())
            if len(self._banned) and best in self._banned:  # rare: mask a copy, look again
                logits = logits.copy()
                logits[self._banned] = -np.inf
                best = int(logits.argmax())
            return best
        return int(C.llama_sampler_sample(self._chain, ctx, idx))

    def grammar_stacks(self) -> int:
        """The grammar's parse stacks now (0 without a grammar, or when not counted)."""
        return parse_stacks(self._grammar) if self._grammar is not None else 0

    def free(self) -> None:
        if self._chain is not None:
            C.llama_sampler_free(self._chain)  # and the grammar sampler it took over
            self._chain = None
            self._grammar = None


class LlamaRuntime:
    """A loaded model with one context; owns their lifetimes (``close`` frees both)."""

    def __init__(self, cfg: RuntimeConfig) -> None:
        self.backend = init_backend()
        self.cfg = cfg
        self._stack = contextlib.ExitStack()
        path = Path(cfg.model_path)
        if not path.is_file():
            raise LlamaError(f"model file not found: {path}")
        mparams = C.llama_model_default_params()
        mparams.n_gpu_layers = cfg.n_gpu_layers
        mparams.use_extra_bufts = cfg.repack
        if cfg.repack and self.backend.amx and not os.environ.get("POLYKV_ALLOW_AMX"):
            # ggml's AMX kernels are only reached through the extra buffer types; on CPUs
            # where the thread lacks the AMX permission they die with SIGILL.
            log.warning("this llama.cpp build has AMX kernels: weight repacking is turned off")
            mparams.use_extra_bufts = False
        self.repack = bool(mparams.use_extra_bufts)
        model = C.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise LlamaError(f"failed to load model from {path} (see the log above)")
        self._model = model
        self._stack.callback(C.llama_model_free, model)
        self._vocab = C.llama_model_get_vocab(model)
        self.info = self._read_info(path)
        vocab = self._vocab
        self._eog = tuple(t for t in range(self.info.n_vocab) if C.llama_vocab_is_eog(vocab, t))
        self.counts_grammar_stacks = layout_ok(self._vocab)
        if not self.counts_grammar_stacks:
            log.warning(
                "this llama.cpp build keeps grammar parse stacks where the engine does not "
                "look: their number is not bounded while requests decode"
            )
        info = self.info
        windowed = info.n_swa > 0 and not (info.is_recurrent or info.is_hybrid)
        self.guard_seqs = cfg.guard_seqs if windowed else 0
        n_seq_max = cfg.n_seq_max + self.guard_seqs
        if n_seq_max > C.llama_max_parallel_sequences():
            self.close()
            raise LlamaError(
                f"{n_seq_max} sequences requested; llama.cpp supports at most "
                f"{C.llama_max_parallel_sequences()} (lower --parallel or --polykv-max-pools)"
            )

        cparams = C.llama_context_default_params()
        cparams.n_ctx = cfg.n_ctx
        cparams.n_batch = cfg.n_batch
        cparams.n_ubatch = min(cfg.n_ubatch, cfg.n_batch)
        cparams.n_seq_max = n_seq_max
        self.n_threads = cfg.n_threads or budget().threads
        self.n_threads_batch = cfg.n_threads_batch or self.n_threads
        self.omp_wait = decide_once().policy
        self.cpu_limit = budget().quota
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads_batch
        cparams.kv_unified = cfg.kv_unified
        cparams.swa_full = cfg.swa_full
        cparams.flash_attn_type = self._flash_attn_type(cfg)
        cparams.type_k = CACHE_TYPES[cfg.cache_type_k]
        cparams.type_v = CACHE_TYPES[cfg.cache_type_v]
        if cfg.kv_debug:
            os.environ["LLAMA_KV_CACHE_DEBUG"] = "1"  # read when the KV cache is built
        ctx = C.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise LlamaError("failed to create the llama context (see the log above)")
        self.ctx = ctx
        self._stack.callback(C.llama_free, ctx)
        self._mem = C.llama_get_memory(ctx)
        self.n_ctx = int(C.llama_n_ctx(ctx))
        self.n_batch = int(C.llama_n_batch(ctx))
        self.n_seq_max = int(C.llama_n_seq_max(ctx))
        self.n_ctx_seq = int(C.llama_n_ctx_seq(ctx))
        self.can_shift = bool(C.llama_memory_can_shift(self._mem))
        self.kv_bytes_per_token, self.swa_bytes_per_token, self.state_bytes = self._measure_memory()

    def kv_layout(self) -> str:
        """What shapes this context's serialized KV bytes beside the model file: cache
        types, the attention kernel (it decides whether V is stored transposed), streams,
        the window layers' cache, offloaded layers."""
        cfg = self.cfg
        fa = {
            int(C.LLAMA_FLASH_ATTN_TYPE_ENABLED): "on",
            int(C.LLAMA_FLASH_ATTN_TYPE_DISABLED): "off",
        }
        return (
            f"k={cfg.cache_type_k} v={cfg.cache_type_v} "
            f"fa={fa.get(self._flash_attn_type(cfg), 'auto')} unified={int(cfg.kv_unified)} "
            f"swa_full={int(cfg.swa_full)} ngl={cfg.n_gpu_layers}"
        )

    @property
    def build_label(self) -> str:
        """The llama-cpp-python release and PolyKV's patches to it."""
        return f"llama-cpp-python {llama_cpp.__version__}; patches {','.join(self.backend.patches)}"

    def library_files(self) -> list[Path]:
        """The llama.cpp libraries this process runs (libllama, ggml's base and the CPU
        backend ggml chose): what a snapshot's build digest is taken over."""
        found = [_mapped(r"libllama\.so[.0-9]*"), _mapped(r"libggml-base\.so[.0-9]*")]
        found.append(self.backend.cpu_library)
        return [Path(p) for p in found if p]

    @staticmethod
    def _flash_attn_type(cfg: RuntimeConfig) -> int:
        # "auto" is on where layers run on the CPU: in one unified cache the plain kernel
        # computes every query against every used cell (other sessions' included, masked
        # afterwards), while ggml's CPU flash attention skips masked cells. Measured with
        # 8 sessions of 1.6k tokens each: 2.5x faster overall; at 8 x 150 tokens, 1.1x.
        # With layers offloaded, llama.cpp's own AUTO decides per device.
        if cfg.flash_attn == "on" or (cfg.flash_attn == "auto" and cfg.n_gpu_layers == 0):
            return int(C.LLAMA_FLASH_ATTN_TYPE_ENABLED)
        if cfg.flash_attn == "off":
            return int(C.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        return int(C.LLAMA_FLASH_ATTN_TYPE_AUTO)

    def _read_info(self, path: Path) -> ModelInfo:
        m = self._model
        buf = ctypes.create_string_buffer(256)
        C.llama_model_desc(m, buf, ctypes.sizeof(buf))
        tmpl = C.llama_model_chat_template(m, None)
        arch = ctypes.create_string_buffer(64)
        if C.llama_model_meta_val_str(m, b"general.architecture", arch, ctypes.sizeof(arch)) < 0:
            arch.value = b""
        return ModelInfo(
            path=str(path),
            description=buf.value.decode("utf-8", "replace"),
            n_vocab=int(C.llama_vocab_n_tokens(self._vocab)),
            n_ctx_train=int(C.llama_model_n_ctx_train(m)),
            n_embd=int(C.llama_model_n_embd(m)),
            n_layer=int(C.llama_model_n_layer(m)),
            n_head=int(C.llama_model_n_head(m)),
            n_head_kv=int(C.llama_model_n_head_kv(m)),
            n_params=int(C.llama_model_n_params(m)),
            size_bytes=int(C.llama_model_size(m)),
            is_recurrent=bool(C.llama_model_is_recurrent(m)),
            is_hybrid=bool(C.llama_model_is_hybrid(m)),
            n_swa=int(C.llama_model_n_swa(m)),
            chat_template=tmpl.decode("utf-8", "replace") if tmpl else None,
            architecture=arch.value.decode("utf-8", "replace"),
            bos=int(C.llama_vocab_bos(self._vocab)),
            eos=int(C.llama_vocab_eos(self._vocab)),
            add_bos=bool(C.llama_vocab_get_add_bos(self._vocab)),
        )

    def _measure_memory(self) -> tuple[int, int, int]:
        """(bytes one token takes in the attention caches, of which in the sliding-window
        layers' cache, bytes of one sequence's recurrent state), as llama.cpp serializes a
        sequence: two one-token decodes into the empty cache, removed afterwards. Measured,
        not derived from the shape: head sizes (Gemma's exceed embd/heads), which layers
        attend (hybrids), cache types and recurrent state layouts all differ by model."""
        info = self.info
        partial = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # a hybrid's state, an iSWA's window
        batch = Batch(1)
        sizes = []
        try:
            for pos in range(2):
                batch.clear()
                batch.add(max(info.bos, 0), pos, 0, False)
                if self.decode(batch) != 0:
                    raise LlamaError("no room in the KV cache for 2 tokens")
                sizes.append(
                    (
                        int(C.llama_state_seq_get_size(self.ctx, 0)),
                        int(C.llama_state_seq_get_size_ext(self.ctx, 0, partial)),
                    )
                )
        finally:
            batch.free()
            C.llama_memory_seq_rm(self._mem, 0, -1, -1)
        # Each cell also carries its position, seq count and seq id (12 bytes) per
        # attention cache: a sliding-window model has two, a recurrent one none.
        caches = 0 if info.is_recurrent else 1 + (info.n_swa > 0)
        per_token = max(sizes[1][0] - sizes[0][0] - 12 * caches, 0)
        if info.is_recurrent or info.is_hybrid:
            return per_token, 0, sizes[1][1]
        swa = sizes[1][1] - sizes[0][1] - 12 if info.n_swa > 0 else 0
        return per_token, swa, 0

    # ------------------------------------------------------------------ vocabulary (any thread)

    def compile_grammar(self, grammar: Grammar) -> CompiledGrammar:
        """The grammar, within the bounds and parsed by llama.cpp (GrammarError otherwise).
        Any thread but the engine's: it only reads the vocabulary, and a large grammar
        takes llama.cpp a while."""
        return CompiledGrammar(self._vocab, grammar)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise LlamaError("tokenization failed")
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (may be a fragment of a UTF-8 character)."""
        buf = ctypes.create_string_buffer(64)
        n = C.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self._vocab, token))

    def valid_token(self, token: int) -> bool:
        return 0 <= token < self.info.n_vocab

    # ------------------------------------------------------------------ engine thread only

    def new_batch(self) -> Batch:
        batch = Batch(self.n_batch)
        self._stack.callback(batch.free)
        return batch

    def new_sampler(
        self, params: SamplingParams, grammar: CompiledGrammar | None, ban_eog: bool = False
    ) -> Sampler:
        """``ban_eog``: never sample an end-of-generation token (``ignore_eos``)."""
        banned = self.eog_tokens() if ban_eog else ()
        return Sampler(params, self.info.n_vocab, grammar, self.counts_grammar_stacks, banned)

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary."""
        return self._eog

    def logits(self, idx: int) -> np.ndarray:
        """The raw logits at batch index ``idx``: a view into llama.cpp's buffer, valid until
        the next decode (copy to keep)."""
        ptr = C.llama_get_logits_ith(self.ctx, idx)
        if not ptr:
            raise LlamaError(f"no logits at batch index {idx}")
        return np.ctypeslib.as_array(ptr, shape=(self.info.n_vocab,))

    def token_logprobs(self, idx: int, token: int, n_top: int) -> TokenLogprobs:
        """log-softmax of the raw logits at batch index ``idx`` (what the model predicted,
        before any sampler): the chosen token's logprob and the ``n_top`` most likely."""
        logits = self.logits(idx).astype(np.float64)
        peak = float(logits.max())
        lse = peak + math.log(float(np.exp(logits - peak).sum()))
        top: tuple[tuple[int, float], ...] = ()
        if n_top > 0:
            n = min(n_top, logits.size)
            best = np.argpartition(-logits, n - 1)[:n]
            best = best[np.argsort(-logits[best], kind="stable")]
            top = tuple((int(t), float(logits[t]) - lse) for t in best)
        return TokenLogprobs(token, float(logits[token]) - lse, top)

    def decode(self, batch: Batch) -> int:
        """Run one batch. Returns 0, or 1 when no KV slot was found (state restored)."""
        if batch.n == 0:
            return 0
        raw = batch._raw
        raw.n_tokens = batch.n
        rc = int(C.llama_decode(self.ctx, raw))
        if rc not in (0, 1):
            raise LlamaError(f"llama_decode returned {rc}")
        return rc

    def _check_seq(self, *seqs: int) -> None:
        for s in seqs:
            if not 0 <= s < self.n_seq_max:
                raise LlamaError(f"sequence id {s} outside [0, {self.n_seq_max})")

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        if not self.try_seq_rm(seq, p0, p1):
            raise LlamaError(f"seq_rm({seq}, {p0}, {p1}) failed")

    def try_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq``; False (nothing changed) where the memory
        cannot: a recurrent state cannot be cut back to an earlier position."""
        self._check_seq(seq)
        return bool(C.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._check_seq(src, dst)
        if not self.cfg.kv_unified and p1 >= 0:
            # llama.cpp aborts on a partial copy between streams of a split cache.
            raise LlamaError("partial seq_cp needs a unified KV cache")
        C.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        self._check_seq(seq)
        C.llama_memory_seq_add(self._mem, seq, p0, p1, delta)

    def seq_save(self, seq: int) -> bytearray:
        """The cells of ``seq`` (tokens' positions and K/V rows; a recurrent state),
        serialized by llama.cpp straight into the returned buffer."""
        self._check_seq(seq)
        size = int(C.llama_state_seq_get_size(self.ctx, seq))
        out = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(out)
        n = int(C.llama_state_seq_get_data(self.ctx, buf, size, seq))
        del buf  # the export must go before the bytearray may change size
        if n != size:
            del out[n:]
        return out

    def seq_load(self, seq: int, data: bytes | bytearray | memoryview) -> bool:
        """Put saved cells back, into the empty ``seq`` at their saved positions. False when
        llama.cpp finds no room for them or refuses the bytes (``seq`` stays empty). The
        bytes are read in place, not copied (a snapshot can be hundreds of MB)."""
        self._check_seq(seq)
        view = memoryview(data).cast("B")
        if view.readonly:  # ctypes only maps writable buffers; bytes from a file are not
            view = memoryview(bytearray(view))
        buf = (ctypes.c_uint8 * len(view)).from_buffer(view)
        return int(C.llama_state_seq_set_data(self.ctx, buf, len(view), seq)) > 0

    def seq_pos_min(self, seq: int) -> int:
        """The smallest position ``seq`` still holds (-1 when empty). With a sliding-window
        cache this is the SWA layers' view: cells that fell out of the window are reused."""
        self._check_seq(seq)
        return int(C.llama_memory_seq_pos_min(self._mem, seq))

    def seq_pos_max(self, seq: int) -> int:
        self._check_seq(seq)
        return int(C.llama_memory_seq_pos_max(self._mem, seq))

    def warm_up(self, seq: int) -> None:
        """Run the model once, the way requests will (a prompt chunk, then one decoded
        token, on every thread), and leave the cache as it was: a model or CPU backend that
        cannot run fails here, at boot, instead of on the first user's request."""
        self._check_seq(seq)
        first = self.info.bos if self.info.bos >= 0 else 0
        last = self.info.eos if self.info.eos >= 0 else first
        batch = Batch(min(self.n_batch, 8))
        try:
            for i, tok in enumerate([first, last, first, last]):
                batch.add(tok, i, seq, i == 3)
            if self.decode(batch) != 0:
                raise LlamaError("warm-up: no room in the KV cache for 4 tokens")
            batch.clear()
            batch.add(first, 4, seq, True)
            if self.decode(batch) != 0:
                raise LlamaError("warm-up: no room in the KV cache for 5 tokens")
            if not C.llama_get_logits_ith(self.ctx, 0):
                raise LlamaError("warm-up: the model produced no logits")
        finally:
            batch.free()
            C.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def measure_used_cells(self, probe_seq: int) -> int | None:
        """Used KV cells as llama.cpp counts them: decode one probe token into the empty
        ``probe_seq`` and read the count its slot search logs, then remove the probe."""
        global _used_capture
        if not self.cfg.kv_debug:
            return None
        self._check_seq(probe_seq)
        batch = C.llama_batch_init(1, 0, 1)
        try:
            batch.n_tokens = 1
            batch.token[0] = self.info.bos
            batch.pos[0] = 0
            batch.n_seq_id[0] = 1
            batch.seq_id[0][0] = probe_seq
            batch.logits[0] = 0
            _used_capture = []
            rc = C.llama_decode(self.ctx, batch)
            seen, _used_capture = _used_capture, None
        finally:
            _used_capture = None
            C.llama_memory_seq_rm(self._mem, probe_seq, -1, -1)
            C.llama_batch_free(batch)
        return seen[0] if rc == 0 and seen else None

    def clear_memory(self) -> None:
        C.llama_memory_clear(self._mem, True)

    def close(self) -> None:
        self._stack.close()
