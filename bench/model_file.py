"""What a GGUF says before any server runs it, read through libllama in this process: its
end-of-generation tokens and its shape. Loading libllama here is why these are apart."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from .harness import BenchError

_callbacks: list[Any] = []  # libllama keeps a raw pointer: the ctypes callback must outlive it


def _ignore(level: int, text: bytes, user: ctypes.c_void_p) -> None:
    return None


def quiet_llama_logs() -> None:
    """Silence libllama's log in this process (once)."""
    import llama_cpp.llama_cpp as C

    if not _callbacks:
        _callbacks.append(C.llama_log_callback(_ignore))
        C.llama_log_set(_callbacks[0], ctypes.c_void_p(0))


def eog_tokens(model: Path) -> list[int]:
    """Token ids llama.cpp treats as end of generation (for the baseline's logit_bias)."""
    import llama_cpp.llama_cpp as C

    quiet_llama_logs()
    params = C.llama_model_default_params()
    params.vocab_only = True
    handle = C.llama_model_load_from_file(str(model).encode(), params)
    if not handle:
        raise BenchError(f"cannot read the vocabulary of {model}")
    try:
        vocab = C.llama_model_get_vocab(handle)
        n = int(C.llama_vocab_n_tokens(vocab))
        return [t for t in range(n) if C.llama_vocab_is_eog(vocab, t)]
    finally:
        C.llama_model_free(handle)


def model_shape(model: Path) -> dict[str, int]:
    """Layer count and width from the GGUF (for the attention-cost arithmetic)."""
    import llama_cpp.llama_cpp as C

    from polykv_engine.llama.runtime import init_backend

    init_backend()  # per-CPU ggml builds load their backend at run time, as the engine does
    quiet_llama_logs()
    params = C.llama_model_default_params()  # mmap: the weights are not read, only mapped
    handle = C.llama_model_load_from_file(str(model).encode(), params)
    if not handle:
        raise BenchError(f"cannot read {model}")
    try:
        return {
            "n_layer": int(C.llama_model_n_layer(handle)),
            "n_embd": int(C.llama_model_n_embd(handle)),
            "n_params": int(C.llama_model_n_params(handle)),
        }
    finally:
        C.llama_model_free(handle)
