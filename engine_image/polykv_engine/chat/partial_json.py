"""A JSON scanner that accepts a document cut off anywhere (pure).

A model's output grows token by token. To stream a tool call's name and arguments, the
parser needs to know, for the text seen so far, which values have started, which have ended,
and the exact source span of each: the arguments are streamed as the model's own text, so
what a client concatenates equals the final ``arguments`` string. ``scan`` returns that tree;
a value cut off by the end of the text has ``end is None``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["object", "array", "string", "number", "literal"]
_WS = " \t\r\n"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class NotJson(ValueError):
    """The text cannot be (the beginning of) a JSON value."""


@dataclass
class Node:
    kind: Kind
    start: int
    end: int | None = None  # index after the value's last character; None: cut off
    items: list[tuple[str | None, Node]] = field(default_factory=list)  # (key, value)
    text: str = ""  # a string's decoded characters so far

    @property
    def complete(self) -> bool:
        return self.end is not None

    def get(self, key: str) -> Node | None:
        for k, v in self.items:
            if k == key:
                return v
        return None

    def source(self, doc: str) -> str:
        """The value's own text, as far as it goes."""
        return doc[self.start : self.end if self.end is not None else len(doc)]


def skip_ws(doc: str, pos: int) -> int:
    while pos < len(doc) and doc[pos] in _WS:
        pos += 1
    return pos


def scan(doc: str, pos: int = 0) -> Node:
    """The value starting at ``pos`` (after whitespace). Raises NotJson when what is there
    cannot begin a JSON value; a value cut off by the end of ``doc`` is returned partial."""
    pos = skip_ws(doc, pos)
    if pos >= len(doc):
        raise NotJson("no value yet")
    node, _ = _value(doc, pos)
    return node


def _value(doc: str, pos: int) -> tuple[Node, int]:
    c = doc[pos]
    if c == "{":
        return _container(doc, pos, "object")
    if c == "[":
        return _container(doc, pos, "array")
    if c == '"':
        return _string(doc, pos)
    if c in "-0123456789":
        return _number(doc, pos)
    for word in ("true", "false", "null"):
        tail = doc[pos : pos + len(word)]
        if word.startswith(tail):
            if len(tail) < len(word):
                return Node("literal", pos), len(doc)
            return Node("literal", pos, pos + len(word)), pos + len(word)
    raise NotJson(f"unexpected {c!r} at {pos}")


def _number(doc: str, pos: int) -> tuple[Node, int]:
    end = pos
    while end < len(doc) and doc[end] in "+-0123456789.eE":
        end += 1
    if end == len(doc):
        return Node("number", pos), end  # more digits may follow
    try:
        json.loads(doc[pos:end])
    except ValueError as exc:
        raise NotJson(f"bad number at {pos}") from exc
    return Node("number", pos, end), end


def _string(doc: str, pos: int) -> tuple[Node, int]:
    node = Node("string", pos)
    out: list[str] = []
    i = pos + 1
    while i < len(doc):
        c = doc[i]
        if c == '"':
            node.text, node.end = "".join(out), i + 1
            return node, i + 1
        if c == "\\":
            if i + 1 >= len(doc):
                break  # an escape cut in half: stop before it
            e = doc[i + 1]
            if e == "u":
                hexa = doc[i + 2 : i + 6]
                if len(hexa) < 4:
                    break
                try:
                    out.append(chr(int(hexa, 16)))
                except ValueError as exc:
                    raise NotJson(f"bad \\u escape at {i}") from exc
                i += 6
                continue
            if e not in _ESCAPES:
                raise NotJson(f"bad escape at {i}")
            out.append(_ESCAPES[e])
            i += 2
            continue
        out.append(c)
        i += 1
    node.text = "".join(out)
    return node, len(doc)


def _container(doc: str, pos: int, kind: Kind) -> tuple[Node, int]:
    node = Node(kind, pos)
    close = "}" if kind == "object" else "]"
    i = skip_ws(doc, pos + 1)
    if i < len(doc) and doc[i] == close:
        node.end = i + 1
        return node, i + 1
    while i < len(doc):
        key: str | None = None
        if kind == "object":
            if doc[i] != '"':
                raise NotJson(f"expected a key at {i}")
            key_node, i = _string(doc, i)
            if not key_node.complete:
                return node, len(doc)
            key = key_node.text
            i = skip_ws(doc, i)
            if i >= len(doc):
                return node, i
            if doc[i] != ":":
                raise NotJson(f"expected ':' at {i}")
            i = skip_ws(doc, i + 1)
            if i >= len(doc):
                return node, i
        value, i = _value(doc, i)
        node.items.append((key, value))
        if not value.complete:
            return node, len(doc)
        i = skip_ws(doc, i)
        if i >= len(doc):
            return node, i
        if doc[i] == close:
            node.end = i + 1
            return node, i + 1
        if doc[i] != ",":
            raise NotJson(f"expected ',' or {close!r} at {i}")
        i = skip_ws(doc, i + 1)
    return node, len(doc)
