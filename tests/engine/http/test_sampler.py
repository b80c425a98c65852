"""Plain greedy sampling is an argmax taken in numpy (no candidate array): it must pick what
llama.cpp's greedy sampler picks, at every position of a real decode."""

from __future__ import annotations

from pathlib import Path

import llama_cpp.llama_cpp as C

from polykv_engine.llama.runtime import LlamaRuntime, RuntimeConfig
from polykv_engine.llama.sampling import SamplingParams


def test_the_greedy_argmax_matches_llama_cpps_greedy_sampler(test_model: Path) -> None:
    rt = LlamaRuntime(RuntimeConfig(test_model, n_ctx=1024, n_seq_max=4))
    chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
    fast = rt.new_sampler(SamplingParams(temperature=0.0), None)
    try:
        assert fast._logits_type is not None  # the argmax path is the one under test
        prompts = ["The quick brown fox", "def f(x):", "Shared prefixes", "A"]
        batch = rt.new_batch()
        n = 0
        for seq, text in enumerate(prompts):
            for pos, tok in enumerate(rt.tokenize(text, add_special=True, parse_special=True)):
                batch.add(tok, pos, seq, True)  # logits at every position: many rows
                n += 1
        assert rt.decode(batch) == 0
        picks = [
            (fast.sample(rt.ctx, i), int(C.llama_sampler_sample(chain, rt.ctx, i)))
            for i in range(n)
        ]
        assert n >= 12 and all(a == b for a, b in picks), picks
    finally:
        fast.free()
        C.llama_sampler_free(chain)
        rt.close()


def test_constrained_or_penalized_greedy_keeps_llama_cpps_chain(test_model: Path) -> None:
    rt = LlamaRuntime(RuntimeConfig(test_model, n_ctx=256))
    try:
        for params in (
            SamplingParams(temperature=0.0, repeat_penalty=1.3),
            SamplingParams(temperature=0.7),
        ):
            s = rt.new_sampler(params, None)
            assert s._logits_type is None
            s.free()
    finally:
        rt.close()
