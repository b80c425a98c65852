"""Grammars for constrained sampling: GBNF text, JSON Schema converted to GBNF, its bounds
checked, and llama.cpp's grammar sampler built from it before a request is queued.

The sampler is built once, off the engine thread (parsing 4 MiB of GBNF takes llama.cpp
~170 ms), and the slot's sampler chain takes it over: the engine thread never parses a
grammar, so decoding sessions never wait on one.

The converter is llama-cpp-python's port of llama.cpp's own ``json_schema_to_grammar``, so
schemas mean here what they mean to llama-server.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import llama_cpp.llama_cpp as C
from llama_cpp import llama_grammar
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from polykv_api.limits import (
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_CHAIN,
    MAX_GRAMMAR_DEPTH,
    MAX_GRAMMAR_ELEMENTS,
    MAX_GRAMMAR_FANOUT,
    MAX_GRAMMAR_RULES,
)
from polykv_api.models import Reason
from polykv_engine.llama.gbnf import GbnfError, GbnfTooLarge, shape
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
_MARK = "__polykv_rule_{}__"

# Rules written here rather than by the converter, one list of GBNF rules per marker (the
# first rule is the one the marker stands for).
Written = list[list[str]]


def _prepare(node: Any, path: str, written: Written) -> Any:
    """A copy of the schema the converter can take: integer bounds and enums replaced by
    markers (turned into rules of our own afterwards), unenforceable keywords refused by
    path. Values (``enum``, ``const``) are data: never read as schema."""
    if isinstance(node, list):
        return [_prepare(v, f"{path}[{i}]", written) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if "enum" in node and "const" not in node and isinstance(node["enum"], list):
        name = f"enum-{len(written)}"
        written.append(enum_rules(name, [json.dumps(v) for v in node["enum"]]))
        return {"const": _MARK.format(len(written) - 1)}
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
        written.append([f"int-range-{len(written)} ::= ({int_range(lo, hi)}) space"])
        return {"const": _MARK.format(len(written) - 1)}
    return {
        k: v if k in ("const", "enum") else _prepare(v, f"{path}.{k}", written)
        for k, v in node.items()
    }


def _literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n").replace("\r", "\\r") + '"'


def enum_rules(name: str, texts: list[str]) -> list[str]:
    """GBNF rules, the first named ``name``, matching exactly ``texts`` (and a space): a
    trie, so the alternatives open at any point begin with different characters. llama.cpp
    keeps a parse stack per alternative it could be in; written one alternative per value,
    an enum of 1000 strings (all beginning with a quote) would hold 1000 of them, and every
    token would be tried against each."""
    rules: list[str] = []
    work = [(name, sorted(set(texts)))]
    while work:
        rule, group = work.pop()
        first, last = group[0], group[-1]  # sorted: their common prefix is everyone's
        n = 0
        while n < min(len(first), len(last)) and first[n] == last[n]:
            n += 1
        prefix = first[:n]
        rests = [t[n:] for t in group]
        alternatives = ['""'] if "" in rests else []
        for _, members in itertools.groupby((r for r in rests if r), key=lambda r: r[0]):
            tails = list(members)
            if len(tails) == 1:
                alternatives.append(_literal(tails[0]))
            else:
                child = f"{name}-{len(rules) + len(work) + 1}"
                work.append((child, tails))
                alternatives.append(child)
        body = " | ".join(alternatives)
        head = f"{_literal(prefix)} " if prefix else ""
        tail = " space" if rule == name else ""
        rules.append(f"{rule} ::= {head}({body}){tail}")
    return rules


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
    written: Written = []
    prepared = _prepare(_open_schemas(schema), "", written)
    try:
        gbnf = _CHAR_RULE.sub(lambda _: _JSON_CHAR, str(json_schema_to_gbnf(json.dumps(prepared))))
        for i, rules in enumerate(written):
            literal = json.dumps(json.dumps(_MARK.format(i)))  # how the converter wrote it
            gbnf = gbnf.replace(literal, rules[0].split(" ", 1)[0])
            gbnf += "".join(f"\n{rule}" for rule in rules)
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
    """Refuse a grammar llama.cpp's recursive parser could not take (its stack), that would
    make it allocate or search more than any the engine serves, or that it would refuse
    anyway; checked before llama.cpp sees the text (``llama/gbnf.py`` reads it as llama.cpp
    will)."""
    size = len(grammar.gbnf.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(
            f"{size} bytes of GBNF, the limit is {MAX_GRAMMAR_BYTES}", reason="grammar_too_large"
        )
    if "\x00" in grammar.gbnf:  # llama.cpp reads a C string: it would parse only a part
        raise GrammarError("GBNF holds a NUL character")
    depth = group_depth(grammar.gbnf)  # first: the shape's parser recurses per group too
    if depth > MAX_GRAMMAR_DEPTH:
        raise GrammarError(
            f"groups nest {depth} deep, the limit is {MAX_GRAMMAR_DEPTH}",
            reason="grammar_too_large",
        )
    try:
        found = shape(grammar.gbnf, MAX_GRAMMAR_RULES, MAX_GRAMMAR_ELEMENTS)
    except GbnfTooLarge as exc:
        raise GrammarError(str(exc), reason="grammar_too_large") from exc
    except GbnfError as exc:
        raise GrammarError(f"not a grammar llama.cpp can parse: {exc}") from exc
    if found.chain > MAX_GRAMMAR_CHAIN:
        raise GrammarError(
            f"{found.chain} rules each begin with the next, the limit is {MAX_GRAMMAR_CHAIN}",
            reason="grammar_too_large",
        )
    if found.fanout > MAX_GRAMMAR_FANOUT:
        shown = f"{found.fanout}" if found.fanout < 1 << 40 else "more than 2**40"
        raise GrammarError(
            f"one step can open {shown} parse stacks (alternatives reachable at once), the "
            f"limit is {MAX_GRAMMAR_FANOUT}",
            reason="grammar_too_large",
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


class CompiledGrammar:
    """A grammar within the bounds, parsed by llama.cpp into a sampler: built on whatever
    thread prepares the request, then taken over by one slot's sampler chain. Freed here if
    no slot ever takes it (a request refused or cancelled before it reached one)."""

    def __init__(self, vocab: Any, grammar: Grammar) -> None:
        check_bounds(grammar)
        self.grammar = grammar
        self._ptr = sampler(vocab, grammar)
        self._owned = weakref.finalize(self, C.llama_sampler_free, self._ptr)

    def take(self) -> Any:
        """The llama.cpp sampler, for a chain that frees it; once."""
        if not self._owned.alive:
            raise RuntimeError("this grammar's sampler was taken already")
        self._owned.detach()
        return self._ptr


# llama.cpp keeps a grammar's parse stacks in its struct llama_grammar, which the API does
# not expose. They are read at their offsets in this build (x86-64, libstdc++: a pointer 8
# bytes, a std::string 32, a std::vector 24): llama_sampler {iface, ctx};
# llama_sampler_grammar {vocab, grammar_str, grammar_root, grammar*};
# llama_grammar {vocab, rules, stacks, ...}. ``layout_ok`` checks them on known grammars
# before any request relies on them.
_GRAMMAR_AT = 8 + 32 + 32
_RULES_AT = 8
_STACKS_AT = 8 + 24
_VECTOR = 24


def _vector_len(addr: int, item_bytes: int) -> int:
    begin, end = ctypes.cast(addr, ctypes.POINTER(ctypes.c_size_t))[0:2]
    return int(end - begin) // item_bytes


def _grammar_of(smpl: Any) -> int:
    ctx = ctypes.cast(smpl, ctypes.POINTER(ctypes.c_void_p))[1]
    return int(ctypes.cast(ctx + _GRAMMAR_AT, ctypes.POINTER(ctypes.c_size_t))[0]) if ctx else 0


def parse_stacks(smpl: Any) -> int:
    """How many parse stacks a grammar sampler holds now (0 for a lazy grammar that has
    not been triggered yet). Only after ``layout_ok``."""
    grammar = _grammar_of(smpl)
    return _vector_len(grammar + _STACKS_AT, _VECTOR) if grammar else 0


def layout_ok(vocab: Any) -> bool:
    """Whether ``parse_stacks`` reads this build right: known grammars, known counts."""
    for gbnf, rules, stacks in (
        ('root ::= "a" | "b" | "c"', 1, 3),
        ('root ::= x "y"\nx ::= "x"', 2, 1),
    ):
        smpl = sampler(vocab, Grammar(gbnf))
        try:
            grammar = _grammar_of(smpl)
            if not grammar or _vector_len(grammar + _RULES_AT, _VECTOR) != rules:
                return False
            if parse_stacks(smpl) != stacks:
                return False
        finally:
            C.llama_sampler_free(smpl)
    return True
