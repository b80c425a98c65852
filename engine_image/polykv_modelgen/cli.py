"""polykv-make-model: write a deterministic GGUF with random weights.

No test or benchmark downloads a model; they run on files made here. The same arguments
always give a byte-identical file: weights come from numpy generators seeded by (seed, tensor
name), and the vocabulary and merges are trained from built-in text (polykv_modelgen.vocab).
Four architectures (polykv_modelgen.archs): plain attention (llama), sliding-window attention
(gemma3), recurrent (mamba) and hybrid (jamba).

    polykv-make-model --preset test  models/polykv-test.gguf    # ~1.9 MB, f32, for the suite
    polykv-make-model --preset bench models/polykv-bench.gguf   # ~160 MB, f16, for benchmarks
    polykv-make-model --preset test-swa models/polykv-test-swa.gguf   # and test-mamba, test-jamba
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np

from polykv_modelgen import vocab as mv
from polykv_modelgen.archs import (
    ARCHS,
    ModelSpec,
    SpecError,
    add_arch_metadata,
    make_tensor,
    tensor_dtype,
    tensor_shapes,
    validate,
)

__all__ = ["PRESETS", "ModelSpec", "SpecError", "main", "tensor_shapes", "validate", "write_model"]

PRESETS: dict[str, ModelSpec] = {
    "test": ModelSpec(layers=2, embd=64, heads=4, heads_kv=2, ff=192, dtype="f32", ctx=8192),
    "bench": ModelSpec(layers=12, embd=768, heads=12, heads_kv=4, ff=2048, dtype="f16", ctx=16384),
    # Sliding window: layer 0 sees the last 32 tokens, layer 1 everything (a short window,
    # so a test's prompts and turns run past it many times).
    "test-swa": ModelSpec(
        layers=2, embd=64, heads=4, heads_kv=2, ff=192, dtype="f32", ctx=8192,
        arch="gemma3", window=32, swa_pattern=2,
    ),
    "test-mamba": ModelSpec(
        layers=2, embd=64, heads=4, heads_kv=2, ff=192, dtype="f32", ctx=8192, arch="mamba"
    ),
    # Hybrid: Mamba, attention, Mamba, attention.
    "test-jamba": ModelSpec(
        layers=4, embd=64, heads=4, heads_kv=2, ff=192, dtype="f32", ctx=8192,
        arch="jamba", attn_every=2,
    ),
}  # fmt: skip


def _add_metadata(w: gguf.GGUFWriter, spec: ModelSpec, name: str, vocab: mv.Vocab) -> None:
    ftype = gguf.LlamaFileType.MOSTLY_F16 if spec.dtype == "f16" else gguf.LlamaFileType.ALL_F32
    w.add_name(name)
    w.add_file_type(int(ftype))
    w.add_vocab_size(len(vocab.tokens))
    add_arch_metadata(w, spec)
    w.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    w.add_tokenizer_pre(mv.PRE_TOKENIZER)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    # Required even if empty: a gpt2 vocab without merges fails to load.
    w.add_token_merges(vocab.merges)
    # Explicit ids: without them llama.cpp silently uses token 11 (a byte here) as BOS/EOS.
    w.add_bos_token_id(mv.BOS_ID)
    w.add_eos_token_id(mv.EOS_ID)
    w.add_eot_token_id(mv.IM_END_ID)
    w.add_pad_token_id(mv.PAD_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(mv.CHAT_TEMPLATE)


def write_model(spec: ModelSpec, out: Path, name: str, log: bool = True) -> int:
    """Write the model to `out` (atomically, via a temp file); returns the parameter count."""
    validate(spec)
    t0 = time.monotonic()
    vocab = mv.build_vocab()
    shapes = tensor_shapes(spec, len(vocab.tokens))
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    if log:
        _say(f"{name}: {n_params / 1e6:.2f}M params, vocab {len(vocab.tokens)}, {spec}")

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(None, arch=spec.arch)
    quiet = mv.quiet_token_ids()
    try:
        _add_metadata(writer, spec, name, vocab)
        for tname, shape in shapes.items():
            dt = tensor_dtype(spec, tname, shape)
            writer.add_tensor_info(tname, shape, dt, int(np.prod(shape)) * dt.itemsize)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # Stream: one tensor in memory at a time (the bench model is ~160 MB).
        names = list(shapes)
        for i, (tname, shape) in enumerate(shapes.items()):
            writer.write_tensor_data(make_tensor(spec, tname, shape, quiet))
            layer = tname.split(".")[1] if tname.startswith("blk.") else None
            if log and layer and not names[i + 1].startswith(f"blk.{layer}."):
                _say(f"  layer {layer}/{spec.layers} ({i + 1}/{len(shapes)} tensors)")
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    if log:
        size = out.stat().st_size
        _say(f"wrote {out}: {size / 1e6:.2f} MB in {time.monotonic() - t0:.2f} s")
    return n_params


def _say(msg: str) -> None:
    print(f"polykv-make-model: {msg}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="polykv-make-model",
        description="Write a deterministic random-weight GGUF with a real BPE vocab and a "
        "ChatML chat template. Size and architecture flags override the preset.",
    )
    p.add_argument("out", type=Path, metavar="OUT.gguf")
    presets = "; ".join(
        f"{k}: {v.arch}, {v.layers} layers, embd {v.embd}, heads {v.heads}/{v.heads_kv}, "
        f"ff {v.ff}, {v.dtype}, ctx {v.ctx}"
        for k, v in PRESETS.items()
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="test", help=presets)
    p.add_argument("--layers", type=int)
    p.add_argument("--embd", type=int, help="embedding width")
    p.add_argument("--heads", type=int, help="attention heads (must divide --embd)")
    p.add_argument("--heads-kv", type=int, help="KV heads, GQA (must divide --heads)")
    p.add_argument("--ff", type=int, help="feed-forward width")
    p.add_argument("--dtype", choices=["f32", "f16"])
    p.add_argument("--ctx", type=int, help="declared training context length")
    p.add_argument("--seed", type=int, help="weight RNG seed (default 0)")
    p.add_argument("--logit-scale", type=float, help="std of the output logits (default 4)")
    p.add_argument("--arch", choices=ARCHS, help="architecture (see polykv_modelgen.archs)")
    p.add_argument("--window", type=int, help="gemma3: sliding window in tokens")
    p.add_argument("--swa-pattern", type=int, help="gemma3: every n-th layer is full attention")
    p.add_argument("--ssm-state", type=int, help="mamba/jamba: state size per channel")
    p.add_argument("--ssm-conv", type=int, help="mamba/jamba: convolution width")
    p.add_argument("--attn-every", type=int, help="jamba: one attention layer in n")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ModelSpec)
        if getattr(args, f.name, None) is not None
    }
    spec = dataclasses.replace(PRESETS[args.preset], **overrides)
    try:
        validate(spec)
    except SpecError as exc:
        parser.error(str(exc))  # usage + message, exit status 2
    if not args.out.parent.is_dir():
        parser.error(f"output directory {str(args.out.parent)!r} does not exist")
    try:
        write_model(spec, args.out, name=f"polykv-{args.preset}")
    except OSError as exc:
        _say(f"error: cannot write {args.out}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
