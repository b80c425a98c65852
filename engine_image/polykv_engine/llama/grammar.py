"""Grammars for constrained sampling: GBNF text, JSON Schema converted to GBNF, and a check
that llama.cpp accepts a grammar before a request is queued.

The converter is llama-cpp-python's port of llama.cpp's own ``json_schema_to_grammar``, so
schemas mean here what they mean to llama-server.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import llama_cpp.llama_cpp as C
from llama_cpp import llama_grammar
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from polykv_api.limits import MAX_GRAMMAR_BYTES, MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_RULES
from polykv_api.models import Reason
from polykv_engine.llama.repetition import repetition
from polykv_engine.llama.schema_bounds import SchemaBoundError, check_schema

ANY_JSON_OBJECT = JSON_GBNF  # root: any JSON object, llama.cpp's json.gbnf

# The converter spells maxLength/maxItems/{m,n} as nested optional groups, one per count
# (llama.cpp's GBNF parser recurses once per group: 100000 of them overflow its stack).
# Its repetition builder is replaced by one that writes GBNF's own x{m,n} syntax, as
# llama.cpp's C++ converter does; the meaning of every schema stays the same.
llama_grammar._build_repetition = repetition


class GrammarError(ValueError):
    """A grammar or schema llama.cpp cannot use; the message says why."""

    def __init__(self, message: str, reason: Reason = "invalid_request") -> None:
        super().__init__(message)
        self.reason: Reason = reason


@dataclass(frozen=True, slots=True)
class Grammar:
    """A GBNF grammar; ``triggers`` (regular expressions) make it lazy: sampling is free
    until one matches the output, and constrained from the match on."""

    gbnf: str
    triggers: tuple[str, ...] = ()


# JSON strings may not hold raw control characters; the converter's own rule lets them
# through, so a model could write a newline inside a string and break json.loads.
_CHAR_RULE = re.compile(r"^char ::= .*$", re.MULTILINE)
_JSON_CHAR = (
    r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] '
    r"[0-9a-fA-F] [0-9a-fA-F])"
)


# Keywords the converter cannot enforce. A schema using one is refused rather than served
# with the constraint silently dropped (the output must validate, not merely parse).
_UNENFORCEABLE = {
    "multipleOf", "uniqueItems", "minProperties", "maxProperties", "not", "if", "then",
    "else", "patternProperties", "dependentRequired", "dependentSchemas", "contains",
    "minContains", "maxContains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
}  # fmt: skip
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_MARK = "__polykv_int_range_{}__"


def _prepare(node: Any, path: str, ranges: list[tuple[int | None, int | None]]) -> Any:
    """A copy of the schema the converter can take: integer bounds replaced by markers
    (turned into range rules afterwards), unenforceable keywords refused by path."""
    if isinstance(node, list):
        return [_prepare(v, f"{path}[{i}]", ranges) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    bad = sorted(_UNENFORCEABLE & node.keys())
    if bad:
        raise GrammarError(f"json_schema{path}: {', '.join(bad)} cannot be enforced by a grammar")
    if any(k in node for k in _BOUNDS):
        if node.get("type") != "integer":
            raise GrammarError(f"json_schema{path}: minimum/maximum are enforced on integers only")
        lo, hi = node.get("minimum"), node.get("maximum")
        if "exclusiveMinimum" in node:
            lo = max(v for v in (lo, node["exclusiveMinimum"] + 1) if v is not None)
        if "exclusiveMaximum" in node:
            hi = min(v for v in (hi, node["exclusiveMaximum"] - 1) if v is not None)
        lo = None if lo is None else math.ceil(lo)
        hi = None if hi is None else math.floor(hi)
        if lo is not None and hi is not None and lo > hi:
            raise GrammarError(f"json_schema{path}: no integer lies in [{lo}, {hi}]")
        ranges.append((lo, hi))
        return {"const": _MARK.format(len(ranges) - 1)}
    return {k: _prepare(v, f"{path}.{k}", ranges) for k, v in node.items()}


# Keywords that only annotate. A subschema made of these alone ({"description": ...})
# accepts any value in JSON Schema; the converter knows only {} (as "any object") and
# refuses the rest, so such subschemas are spelt out as every type (Claude Code's tools
# have them).
_ANNOTATIONS = {
    "description", "title", "default", "examples", "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema", "$id",
}  # fmt: skip
_ANY_VALUE = {"type": ["string", "number", "boolean", "object", "array", "null"]}


def _open_schemas(node: Any) -> Any:
    """``node`` with every annotation-only subschema replaced by ``_ANY_VALUE`` (walked by
    position: keys of ``properties`` are names, not keywords)."""
    if not isinstance(node, dict):
        return node
    if node and node.keys() <= _ANNOTATIONS:
        return _ANY_VALUE
    out = dict(node)
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            out[key] = {name: _open_schemas(sub) for name, sub in node[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            out[key] = [_open_schemas(sub) for sub in node[key]]
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out[key] = _open_schemas(node[key])
    return out


def _digits_upto(lo: str, hi: str) -> str:
    """Same-length digit strings from lo to hi, as a GBNF alternation (no sign)."""
    if not lo:
        return '""'
    if lo == hi:
        return f'"{lo}"'
    if lo == "0" * len(lo) and hi == "9" * len(hi):  # every digit string: without this the
        return f"[0-9]{{{len(lo)}}}"  # two ends recurse apart, 2^digits terms (6 MB at 2^53)
    if lo[0] == hi[0]:
        return f'"{lo[0]}" ({_digits_upto(lo[1:], hi[1:])})'
    n = len(lo) - 1
    parts = [f'"{lo[0]}" ({_digits_upto(lo[1:], "9" * n)})']
    if int(hi[0]) - int(lo[0]) > 1:
        middle = f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}]"
        parts.append(middle + "".join(" [0-9]" for _ in range(n)))
    parts.append(f'"{hi[0]}" ({_digits_upto("0" * n, hi[1:])})')
    return " | ".join(parts)


def _natural(lo: int, hi: int | None) -> str:
    """Non-negative integers in [lo, hi] (hi None: unbounded), JSON style (no leading 0)."""
    parts = []
    length = len(str(lo))
    while hi is None or length <= len(str(hi)):
        first = max(lo, 10 ** (length - 1) if length > 1 else 0)
        last = 10**length - 1 if hi is None or length < len(str(hi)) else hi
        if hi is None and first == 10 ** (length - 1) and length > 1:
            parts.append(f"[1-9] [0-9]{{{length - 1},}}")  # every longer number
            break
        if first <= last:
            parts.append(_digits_upto(str(first), str(last)))
        length += 1
        if hi is None and length > len(str(lo)) + 1:
            parts.append(f"[1-9] [0-9]{{{length - 1},}}")
            break
    return " | ".join(f"({p})" for p in parts)


def int_range(lo: int | None, hi: int | None) -> str:
    """A GBNF expression for the JSON integers n with lo <= n <= hi (None: unbounded)."""
    parts = []
    if lo is None or lo < 0:  # negatives: "-" and an absolute value in [max(1,-hi), -lo]
        top = None if lo is None else -lo
        bottom = 1 if hi is None or hi >= 0 else -hi
        parts.append(f'"-" ({_natural(bottom, top)})')
    if hi is None or hi >= 0:
        parts.append(_natural(max(0, lo) if lo is not None else 0, hi))
    return " | ".join(f"({p})" for p in parts)


def from_schema(schema: Mapping[str, Any]) -> str:
    """GBNF accepting exactly the JSON documents that validate against ``schema``."""
    try:
        check_schema(schema)
    except SchemaBoundError as exc:
        raise GrammarError(f"json_schema{exc}", reason="schema_too_large") from exc
    ranges: list[tuple[int | None, int | None]] = []
    prepared = _prepare(_open_schemas(schema), "", ranges)
    try:
        gbnf = _CHAR_RULE.sub(lambda _: _JSON_CHAR, str(json_schema_to_gbnf(json.dumps(prepared))))
        for i, (lo, hi) in enumerate(ranges):
            literal = json.dumps(json.dumps(_MARK.format(i)))  # how the converter wrote it
            gbnf = gbnf.replace(literal, f"int-range-{i}")
            gbnf += f"\nint-range-{i} ::= ({int_range(lo, hi)}) space"
        return gbnf
    except (ValueError, KeyError, TypeError, AssertionError, RecursionError) as exc:
        raise GrammarError(f"json_schema: cannot be turned into a grammar: {exc}") from exc
    except NotImplementedError as exc:
        raise GrammarError(f"json_schema: unsupported construct: {exc}") from exc


# Text that cannot hold a group: literals, character classes, comments. Each alternative
# runs to its closing character or to the end (unclosed), so the scan is linear.
_NOT_GROUPS = re.compile(r'"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|#[^\n]*')
_NOT_PARENS = re.compile(r"[^()]+")


def group_depth(gbnf: str) -> int:
    """How deeply ( ... ) groups nest in ``gbnf`` (outside literals and classes)."""
    return _depth(_NOT_GROUPS.sub("", gbnf))


def _depth(syntax: str) -> int:
    parens = _NOT_PARENS.sub("", syntax)
    depth = deepest = 0
    for c in parens:
        depth += 1 if c == "(" else -1
        deepest = max(deepest, depth)
    return deepest


def check_bounds(grammar: Grammar) -> None:
    """Refuse a grammar llama.cpp's recursive parser could not take (its stack) or that is
    bigger than any the engine serves; checked before llama.cpp sees the text."""
    size = len(grammar.gbnf.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(
            f"{size} bytes of GBNF, the limit is {MAX_GRAMMAR_BYTES}", reason="grammar_too_large"
        )
    if "\x00" in grammar.gbnf:  # llama.cpp reads a C string: it would parse only a part
        raise GrammarError("GBNF holds a NUL character")
    syntax = _NOT_GROUPS.sub("", grammar.gbnf)
    depth = _depth(syntax)
    if depth > MAX_GRAMMAR_DEPTH:
        raise GrammarError(
            f"groups nest {depth} deep, the limit is {MAX_GRAMMAR_DEPTH}",
            reason="grammar_too_large",
        )
    # llama.cpp's left-recursion check also recurses, from rule to rule: a chain of rules
    # each starting with the next is as deep as the rules are many.
    rules = syntax.count("::=")
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarError(
            f"{rules} rules, the limit is {MAX_GRAMMAR_RULES}", reason="grammar_too_large"
        )


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
    """Raise GrammarError unless ``grammar`` is within the bounds and llama.cpp parses it."""
    check_bounds(grammar)
    C.llama_sampler_free(sampler(vocab, grammar))
