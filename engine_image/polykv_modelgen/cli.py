"""polykv-make-model: write a deterministic llama-architecture GGUF with random weights.

No test or benchmark downloads a model; they run on files made here. The same arguments
always give a byte-identical file: weights come from numpy generators seeded by (seed, tensor
name), and the vocabulary and merges are trained from built-in text (polykv_modelgen.vocab).

    polykv-make-model --preset test  models/polykv-test.gguf    # ~1.9 MB, f32, for the suite
    polykv-make-model --preset bench models/polykv-bench.gguf   # ~160 MB, f16, for benchmarks
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from polykv_modelgen import vocab as mv


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    embd: int
    heads: int
    heads_kv: int
    ff: int
    dtype: str  # "f32" | "f16"
    ctx: int  # declared training context: llama.cpp caps every slot at it
    seed: int = 0
    # Logit std is about this value: large enough that greedy decoding wanders over many
    # tokens instead of collapsing onto one, small enough that sampling stays varied.
    logit_scale: float = 4.0

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads


PRESETS: dict[str, ModelSpec] = {
    "test": ModelSpec(layers=2, embd=64, heads=4, heads_kv=2, ff=192, dtype="f32", ctx=8192),
    "bench": ModelSpec(layers=12, embd=768, heads=12, heads_kv=4, ff=2048, dtype="f16", ctx=16384),
}

_RMS_EPS = 1e-5
_ROPE_BASE = 10000.0


class SpecError(ValueError):
    """The requested shape cannot make a valid llama model."""


def validate(spec: ModelSpec) -> None:
    for name in ("layers", "embd", "heads", "heads_kv", "ff", "ctx"):
        if getattr(spec, name) < 1:
            raise SpecError(f"--{name.replace('_', '-')} must be >= 1")
    if spec.embd % spec.heads:
        raise SpecError(f"--heads {spec.heads} must divide --embd {spec.embd}")
    if spec.heads % spec.heads_kv:
        raise SpecError(f"--heads-kv {spec.heads_kv} must divide --heads {spec.heads}")
    if spec.head_dim % 2:
        raise SpecError(f"head size embd/heads = {spec.head_dim} must be even (RoPE rotates pairs)")
    if spec.dtype not in ("f32", "f16"):
        raise SpecError(f"--dtype must be f32 or f16, not {spec.dtype!r}")
    if not spec.logit_scale > 0:
        raise SpecError("--logit-scale must be > 0")
    if not 0 <= spec.seed < 2**63:
        raise SpecError("--seed must be in [0, 2**63)")


def tensor_shapes(spec: ModelSpec, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> numpy shape (out, in), in file order; gguf reverses it to ggml's (in, out)."""
    e, hd = spec.embd, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, e)}
    for i in range(spec.layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (e,)
        shapes[b + "attn_q.weight"] = (spec.heads * hd, e)
        shapes[b + "attn_k.weight"] = (spec.heads_kv * hd, e)
        shapes[b + "attn_v.weight"] = (spec.heads_kv * hd, e)
        shapes[b + "attn_output.weight"] = (e, spec.heads * hd)
        shapes[b + "ffn_norm.weight"] = (e,)
        shapes[b + "ffn_gate.weight"] = (spec.ff, e)
        shapes[b + "ffn_up.weight"] = (spec.ff, e)
        shapes[b + "ffn_down.weight"] = (e, spec.ff)
    shapes["output_norm.weight"] = (e,)
    shapes["output.weight"] = (n_vocab, e)
    return shapes


def make_tensor(spec: ModelSpec, name: str, shape: tuple[int, ...]) -> npt.NDArray[np.generic]:
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)  # norm weights: ggml wants them f32
    # One generator per tensor, keyed by its name: a tensor's values do not depend on
    # which other tensors exist (changing --layers leaves layer 0 as it was).
    rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
    # Linear weights: std 1/sqrt(fan_in) keeps each projection's output near unit scale.
    # Embedding rows feed an RMS norm first, so only their direction matters (std 1).
    std = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[1])
    if name.endswith(("attn_output.weight", "ffn_down.weight")):
        # Residual branches shrink with depth (as GPT-2 does): otherwise 2*layers unit-size
        # additions drown the current token's embedding, and a deep random model (bench)
        # gets stuck repeating one token under greedy decoding.
        std /= np.sqrt(2 * spec.layers)
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if name == "output.weight":
        w *= np.float32(spec.logit_scale)
        # Logit exactly 0 for control and non-text byte tokens, while the best text token
        # scores ~3 std above 0: greedy output is clean ASCII text that never stops on
        # EOS/<|im_end|> by chance (tests bound it with n_predict or stop strings).
        w[mv.quiet_token_ids()] = 0.0
    return w.astype(np.float16) if spec.dtype == "f16" else w


def _add_metadata(w: gguf.GGUFWriter, spec: ModelSpec, name: str, vocab: mv.Vocab) -> None:
    ftype = gguf.LlamaFileType.MOSTLY_F16 if spec.dtype == "f16" else gguf.LlamaFileType.ALL_F32
    w.add_name(name)
    w.add_file_type(int(ftype))
    w.add_vocab_size(len(vocab.tokens))
    w.add_context_length(spec.ctx)
    w.add_embedding_length(spec.embd)
    w.add_block_count(spec.layers)
    w.add_feed_forward_length(spec.ff)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.heads_kv)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(_ROPE_BASE)
    w.add_layer_norm_rms_eps(_RMS_EPS)
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
    writer = gguf.GGUFWriter(None, arch="llama")
    try:
        _add_metadata(writer, spec, name, vocab)
        for tname, shape in shapes.items():
            # 2-D weights take --dtype; norm vectors stay f32 (see make_tensor).
            dt = np.dtype(np.float16 if spec.dtype == "f16" and len(shape) == 2 else np.float32)
            writer.add_tensor_info(tname, shape, dt, int(np.prod(shape)) * dt.itemsize)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # Stream: one tensor in memory at a time (the bench model is ~160 MB).
        for i, (tname, shape) in enumerate(shapes.items()):
            writer.write_tensor_data(make_tensor(spec, tname, shape))
            if log and tname.endswith("ffn_down.weight"):
                _say(f"  layer {tname.split('.')[1]}/{spec.layers} ({i + 1}/{len(shapes)} tensors)")
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
        description="Write a deterministic random-weight llama GGUF with a real BPE vocab "
        "and a ChatML chat template. Size flags override the preset.",
    )
    p.add_argument("out", type=Path, metavar="OUT.gguf")
    presets = "; ".join(
        f"{k}: {v.layers} layers, embd {v.embd}, heads {v.heads}/{v.heads_kv}, ff {v.ff}, "
        f"{v.dtype}, ctx {v.ctx}"
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
