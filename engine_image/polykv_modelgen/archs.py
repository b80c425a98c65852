"""The architectures the generator writes: which tensors each has, their shapes, the values
that make a random model behave, and the metadata llama.cpp reads.

- ``llama``: full attention in every layer (the plain case every pool feature started on).
- ``gemma3``: sliding-window attention (iSWA): layers alternate between a window of
  ``window`` tokens and full attention, every ``swa_pattern``-th layer full, as Gemma 2/3,
  Cohere 2 and gpt-oss do. llama.cpp keeps the window layers in a second cache whose cells
  it recycles once they leave the window.
- ``mamba``: pure recurrent (Mamba-1 selective state space): no KV cache at all, one fixed-size
  state per sequence that is exact only at the end of what was decoded.
- ``jamba``: hybrid: Mamba layers with an attention layer every ``attn_every`` layers, so a
  sequence holds both a recurrent state and attention cells.

Shapes are numpy's (out, in); gguf reverses them into ggml's (in, out).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Literal

import gguf
import numpy as np
import numpy.typing as npt

Arch = Literal["llama", "gemma3", "mamba", "jamba"]
ARCHS: tuple[Arch, ...] = ("llama", "gemma3", "mamba", "jamba")

RMS_EPS = 1e-5
ROPE_BASE = 10000.0


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
    arch: Arch = "llama"
    window: int = 0  # gemma3: the sliding window, in tokens
    swa_pattern: int = 2  # gemma3: every swa_pattern-th layer attends to everything
    ssm_state: int = 16  # mamba/jamba: state size per channel
    ssm_conv: int = 4  # mamba/jamba: causal convolution width
    attn_every: int = 2  # jamba: layer i attends when i % attn_every == attn_every - 1

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads

    @property
    def ssm_inner(self) -> int:
        return 2 * self.embd  # llama.cpp supports an expansion factor of 2 only

    @property
    def dt_rank(self) -> int:
        return math.ceil(self.embd / 16)

    def kind(self, layer: int) -> Literal["attention", "mamba"]:
        if self.arch == "mamba":
            return "mamba"
        if self.arch == "jamba" and layer % self.attn_every != self.attn_every - 1:
            return "mamba"
        return "attention"


class SpecError(ValueError):
    """The requested shape cannot make a valid model."""


def validate(spec: ModelSpec) -> None:
    if spec.arch not in ARCHS:
        raise SpecError(f"--arch must be one of {', '.join(ARCHS)}, not {spec.arch!r}")
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
    if spec.arch == "gemma3":
        if not 1 <= spec.window < spec.ctx:
            raise SpecError(f"--window must be in [1, --ctx {spec.ctx}) for a sliding window")
        if spec.swa_pattern < 2:
            raise SpecError("--swa-pattern must be >= 2 (1 would make every layer full)")
    if spec.arch in ("mamba", "jamba") and (spec.ssm_state < 1 or spec.ssm_conv < 2):
        raise SpecError("--ssm-state must be >= 1 and --ssm-conv >= 2")
    if spec.arch == "jamba" and not 2 <= spec.attn_every <= spec.layers:
        raise SpecError(f"--attn-every must be in [2, --layers {spec.layers}] (a hybrid)")


def tensor_shapes(spec: ModelSpec, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> numpy shape, in file order."""
    e = spec.embd
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, e)}
    for i in range(spec.layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (e,)
        if spec.kind(i) == "mamba":
            shapes.update(_mamba_layer(spec, b))
        else:
            shapes.update(_attention_layer(spec, b))
        if spec.arch == "gemma3":
            shapes[b + "post_attention_norm.weight"] = (e,)
        if spec.arch != "mamba":  # a Mamba block is its own mixer: no feed-forward
            shapes[b + "ffn_norm.weight"] = (e,)
            shapes[b + "ffn_gate.weight"] = (spec.ff, e)
            shapes[b + "ffn_up.weight"] = (spec.ff, e)
            shapes[b + "ffn_down.weight"] = (e, spec.ff)
        if spec.arch == "gemma3":
            shapes[b + "post_ffw_norm.weight"] = (e,)
    shapes["output_norm.weight"] = (e,)
    shapes["output.weight"] = (n_vocab, e)
    return shapes


def _attention_layer(spec: ModelSpec, b: str) -> dict[str, tuple[int, ...]]:
    e, hd = spec.embd, spec.head_dim
    out: dict[str, tuple[int, ...]] = {
        b + "attn_q.weight": (spec.heads * hd, e),
        b + "attn_k.weight": (spec.heads_kv * hd, e),
        b + "attn_v.weight": (spec.heads_kv * hd, e),
        b + "attn_output.weight": (e, spec.heads * hd),
    }
    if spec.arch == "gemma3":
        out[b + "attn_q_norm.weight"] = (hd,)
        out[b + "attn_k_norm.weight"] = (hd,)
    return out


def _mamba_layer(spec: ModelSpec, b: str) -> dict[str, tuple[int, ...]]:
    e, d, n, r = spec.embd, spec.ssm_inner, spec.ssm_state, spec.dt_rank
    out: dict[str, tuple[int, ...]] = {
        b + "ssm_in.weight": (2 * d, e),
        b + "ssm_conv1d.weight": (d, spec.ssm_conv),
        b + "ssm_conv1d.bias": (d,),
        b + "ssm_x.weight": (r + 2 * n, d),
        b + "ssm_dt.weight": (d, r),
        b + "ssm_dt.bias": (d,),
        b + "ssm_a": (d, n),
        b + "ssm_d": (d,),
        b + "ssm_out.weight": (e, d),
    }
    if spec.arch == "jamba":  # Jamba normalizes dt, B and C (weights of ones here)
        out[b + "ssm_dt_norm.weight"] = (r,)
        out[b + "ssm_b_norm.weight"] = (n,)
        out[b + "ssm_c_norm.weight"] = (n,)
    return out


# Tensors llama.cpp's state-space kernels read as f32 whatever the file's type.
_F32_ALWAYS = ("ssm_a", "ssm_d", "ssm_conv1d.weight")


def tensor_dtype(spec: ModelSpec, name: str, shape: tuple[int, ...]) -> np.dtype[np.generic]:
    """2-D weights take the spec's dtype; vectors and the state-space kernels' inputs f32."""
    if spec.dtype == "f16" and len(shape) == 2 and not name.endswith(_F32_ALWAYS):
        return np.dtype(np.float16)
    return np.dtype(np.float32)


def make_tensor(
    spec: ModelSpec, name: str, shape: tuple[int, ...], quiet_ids: list[int]
) -> npt.NDArray[np.generic]:
    # One generator per tensor, keyed by its name: a tensor's values do not depend on
    # which other tensors exist (changing --layers leaves layer 0 as it was).
    rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
    w = _values(spec, name, shape, rng)
    if name == "output.weight":
        w *= np.float32(spec.logit_scale)
        # Logit exactly 0 for control and non-text byte tokens, while the best text token
        # scores ~3 std above 0: greedy output is clean ASCII text that never stops on
        # EOS/<|im_end|> by chance (tests bound it with n_predict or stop strings).
        w[quiet_ids] = 0.0
    return w.astype(tensor_dtype(spec, name, shape))


def _values(
    spec: ModelSpec, name: str, shape: tuple[int, ...], rng: np.random.Generator
) -> npt.NDArray[np.float32]:
    if name.endswith(("ssm_conv1d.bias",)):
        return np.zeros(shape, dtype=np.float32)
    if name.endswith("ssm_a"):
        # S4D-real: A = -(1, 2, ..., N) for every channel (stored as A, not log A).
        return -np.tile(np.arange(1, shape[1] + 1, dtype=np.float32), (shape[0], 1))
    if name.endswith("ssm_dt.bias"):
        # Time steps log-uniform in [1e-3, 1e-1], stored through softplus's inverse.
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape)).astype(np.float32)
        return dt + np.log(-np.expm1(-dt))
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)  # norm weights, the skip gain D
    # Linear weights: std 1/sqrt(fan_in) keeps each projection's output near unit scale.
    # Embedding rows feed an RMS norm first, so only their direction matters (std 1).
    std = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[1])
    if name.endswith(("attn_output.weight", "ffn_down.weight", "ssm_out.weight")):
        # Residual branches shrink with depth (as GPT-2 does): otherwise 2*layers unit-size
        # additions drown the current token's embedding, and a deep random model (bench)
        # gets stuck repeating one token under greedy decoding.
        std /= np.sqrt(2 * spec.layers)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def add_arch_metadata(w: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """The shape keys llama.cpp reads for ``spec.arch`` (prefixed with the arch name)."""
    w.add_context_length(spec.ctx)
    w.add_embedding_length(spec.embd)
    w.add_block_count(spec.layers)
    if spec.arch == "mamba":
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_head_count_kv(0)
    else:
        w.add_feed_forward_length(spec.ff)
        w.add_head_count(spec.heads)
        if spec.arch == "jamba":  # no KV heads in the Mamba layers: that is what marks them
            kinds = [spec.kind(i) for i in range(spec.layers)]
            w.add_head_count_kv([spec.heads_kv if k == "attention" else 0 for k in kinds])
        else:
            w.add_head_count_kv(spec.heads_kv)
    if spec.arch in ("llama", "gemma3"):
        w.add_rope_dimension_count(spec.head_dim)
        w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    if spec.arch == "gemma3":
        w.add_sliding_window(spec.window)
        w.add_uint32(f"{spec.arch}.attention.sliding_window_pattern", spec.swa_pattern)
        w.add_uint32(f"{spec.arch}.attention.key_length", spec.head_dim)
        w.add_uint32(f"{spec.arch}.attention.value_length", spec.head_dim)
        w.add_float32(f"{spec.arch}.rope.freq_base_swa", ROPE_BASE)
    if spec.arch in ("mamba", "jamba"):
        w.add_ssm_conv_kernel(spec.ssm_conv)
        w.add_ssm_inner_size(spec.ssm_inner)
        w.add_ssm_state_size(spec.ssm_state)
        w.add_ssm_time_step_rank(spec.dt_rank)
