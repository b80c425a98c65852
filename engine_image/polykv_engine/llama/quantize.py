"""llama.cpp's own quantizer, for making a model's other quantizations locally."""

from __future__ import annotations

import os
from pathlib import Path

import llama_cpp.llama_cpp as C

from polykv_engine.llama.runtime import LlamaError, init_backend


def quantize(src: Path, dst: Path, ftype: str, allow_requantize: bool = True) -> None:
    """Write ``src`` quantized to ``ftype`` (e.g. "Q8_0", "Q4_K_M") at ``dst``."""
    init_backend()
    name = f"LLAMA_FTYPE_MOSTLY_{ftype}"
    if not hasattr(C, name):
        raise LlamaError(f"unknown quantization type {ftype!r}")
    params = C.llama_model_quantize_default_params()
    params.ftype = getattr(C, name)
    params.allow_requantize = allow_requantize  # the source may itself be quantized
    params.nthread = os.cpu_count() or 1
    rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise LlamaError(f"llama_model_quantize returned {rc} for {src}")
