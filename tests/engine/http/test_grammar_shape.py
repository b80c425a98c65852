"""Grammars as llama.cpp builds them, on a real vocabulary: the engine's own count of rules
(``llama/gbnf.py``) is llama.cpp's, its fan-out bounds the stacks llama.cpp opens, the
parse stacks are read where this build keeps them, and a grammar is parsed once, by
whoever prepares the request, never by the sampler chain the engine thread builds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C
import pytest

from polykv_engine.chat.tools import plan
from polykv_engine.llama import grammar as g
from polykv_engine.llama.gbnf import shape
from polykv_engine.llama.runtime import LlamaRuntime, RuntimeConfig, Sampler
from polykv_engine.llama.sampling import SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    for i in range(128)
]


def corpus() -> dict[str, str]:
    binary = "\n".join(f'r{i} ::= r{i + 1} "1" | r{i + 1} "2"' for i in range(8))
    tools = plan("llama3", TOOLS, "required", True)
    assert tools is not None and tools.grammar is not None
    return {
        "json": g.ANY_JSON_OBJECT,
        "schema": g.from_schema(
            {
                "type": "object",
                "properties": {
                    "setup": {"type": "string", "maxLength": 100000},
                    "n": {"type": "integer", "minimum": -40, "maximum": 1234},
                    "tags": {
                        "type": "array",
                        "items": {"enum": ["a", "b"]},
                        "minItems": 1,
                        "maxItems": 9,
                    },
                },
            }
        ),
        "enum-200": g.from_schema({"enum": [f"value-{i}" for i in range(200)]}),
        "tools-128": tools.grammar.gbnf,
        "binary-8": binary + '\nr8 ::= "a"\nroot ::= r0',
        "optional-50": "root ::= " + '"x"? ' * 50 + '"a"',
        "repetitions": "root ::= " + '"a"{0,1999} ' * 3,
        "nested": 'root ::= ("ab" [c-d]{2,5}){1,3} "z"* ("" | "e")',
        "tokens": 'root ::= <[12]> !<[13]> "x" .',
    }


@pytest.fixture(scope="module")
def rt(test_model: Path) -> Iterator[LlamaRuntime]:
    runtime = LlamaRuntime(RuntimeConfig(test_model, n_ctx=256))
    yield runtime
    runtime.close()


def rules_of(smpl: Any) -> int:
    return g._vector_len(g._grammar_of(smpl) + g._RULES_AT, g._VECTOR)


@pytest.mark.parametrize("name", list(corpus()))
def test_rules_are_llama_cpps_and_the_fanout_bounds_its_first_stacks(
    rt: LlamaRuntime, name: str
) -> None:
    text = corpus()[name]
    counted = shape(text, 10**9, 10**9)
    smpl = rt.compile_grammar(g.Grammar(text)).take()
    try:
        assert rules_of(smpl) == counted.rules
        assert 1 <= g.parse_stacks(smpl) <= counted.fanout
    finally:
        C.llama_sampler_free(smpl)


def test_the_stacks_of_an_ambiguous_grammar_are_read_as_they_double(rt: LlamaRuntime) -> None:
    assert rt.counts_grammar_stacks  # layout_ok held for this build
    (a,) = rt.tokenize("a", add_special=False, parse_special=False)
    smpl = rt.compile_grammar(g.Grammar('root ::= y\ny ::= "a" y "c" | "a" y "d"')).take()
    try:
        seen = [g.parse_stacks(smpl)]
        for _ in range(5):
            C.llama_sampler_accept(smpl, a)
            seen.append(g.parse_stacks(smpl))
    finally:
        C.llama_sampler_free(smpl)
    assert seen == [2, 4, 8, 16, 32, 64]


def test_the_engine_threads_sampler_takes_a_compiled_grammar_and_never_parses_one(
    rt: LlamaRuntime,
) -> None:
    text = 'root ::= "yes" | "no"'
    params = SamplingParams(temperature=0.0, grammar=g.Grammar(text))
    with pytest.raises(ValueError, match="compiled"):
        Sampler(params, rt.info.n_vocab)  # given text alone, it refuses rather than parse
    compiled = rt.compile_grammar(g.Grammar(text))
    s = rt.new_sampler(params, compiled)
    try:
        assert s.grammar_stacks() == 2
        with pytest.raises(RuntimeError, match="taken"):
            compiled.take()  # the chain owns it (and frees it with itself)
    finally:
        s.free()
