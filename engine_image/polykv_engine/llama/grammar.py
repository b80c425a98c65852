"""Grammars for constrained sampling: GBNF text, JSON Schema converted to GBNF, and a check
that llama.cpp accepts a grammar before a request is queued.

The converter is llama-cpp-python's port of llama.cpp's own ``json_schema_to_grammar``, so
schemas mean here what they mean to llama-server.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import llama_cpp.llama_cpp as C
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

ANY_JSON_OBJECT = JSON_GBNF  # root: any JSON object, llama.cpp's json.gbnf


class GrammarError(ValueError):
    """A grammar or schema llama.cpp cannot use; the message says why."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """A GBNF grammar; ``triggers`` (regular expressions) make it lazy: sampling is free
    until one matches the output, and constrained from the match on."""

    gbnf: str
    triggers: tuple[str, ...] = ()


def from_schema(schema: Mapping[str, Any]) -> str:
    """GBNF accepting exactly the JSON documents that validate against ``schema``."""
    try:
        return str(json_schema_to_gbnf(json.dumps(schema)))
    except (ValueError, KeyError, TypeError, AssertionError, RecursionError) as exc:
        raise GrammarError(f"json_schema: cannot be turned into a grammar: {exc}") from exc
    except NotImplementedError as exc:
        raise GrammarError(f"json_schema: unsupported construct: {exc}") from exc


def sampler(vocab: Any, grammar: Grammar) -> Any:
    """A llama.cpp grammar sampler (NULL-checked); the caller owns and frees it."""
    data = grammar.gbnf.encode()
    if grammar.triggers:
        triggers = [t.encode() for t in grammar.triggers]
        patterns = (ctypes.c_char_p * len(triggers))(*triggers)
        smpl = C.llama_sampler_init_grammar_lazy_patterns(
            vocab, data, b"root", patterns, len(grammar.triggers), None, 0
        )
    else:
        smpl = C.llama_sampler_init_grammar(vocab, data, b"root")
    if not smpl:
        raise GrammarError("llama.cpp rejected the grammar (see the engine log for the rule)")
    return smpl


def check(vocab: Any, grammar: Grammar) -> None:
    """Raise GrammarError unless llama.cpp can parse ``grammar``."""
    C.llama_sampler_free(sampler(vocab, grammar))
