"""GBNF for "an item repeated m to n times" in llama.cpp's ``x{m,n}`` syntax (pure).

llama.cpp's parser expands ``x{m,n}`` into a chain of rules without recursing per count,
but refuses a minimum above 2000 and reads a maximum above 2000 as unbounded
(``MAX_REPETITION_THRESHOLD`` in llama-grammar.cpp). So no single count here exceeds
``CAP``; larger ones are spelled as repetitions of chunks of ``CAP`` items, which keeps
every count exact (a maxLength of 100000 still stops at 100000).
"""

from __future__ import annotations

import re

CAP = 500
# The parser also refuses a repetition whose item made k rules when k * count > 2000; a
# chunk nested j deep makes j + 1 rules, so CAP = 500 allows three levels of chunks
# (500**4 items, past any schema bound).

_ATOM = re.compile(r'[A-Za-z0-9-]+|"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\((?:[^()"]|"[^"]*")*\)')


def _atom(item: str) -> str:
    """``item`` as one GBNF element (a name, literal, class or flat group stays as it is)."""
    return item if _ATOM.fullmatch(item) else f"({item})"


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _chunk(x: str) -> str:
    return f"({x}{{{CAP}}})"


def exactly(x: str, n: int) -> str:
    """``x`` exactly ``n`` times ("" for 0)."""
    if n <= CAP:
        return "" if n == 0 else x if n == 1 else f"{x}{{{n}}}"
    q, r = divmod(n, CAP)
    return _join(exactly(_chunk(x), q), exactly(x, r))


def up_to(x: str, n: int) -> str:
    """``x`` between 0 and ``n`` times ("" for 0)."""
    if n <= CAP:
        return "" if n == 0 else f"{x}?" if n == 1 else f"{x}{{0,{n}}}"
    q, r = divmod(n, CAP)
    # Fewer than q whole chunks and a shorter tail, or q chunks and at most r more: every
    # count in [0, n] in exactly one way.
    fewer = _join(up_to(_chunk(x), q - 1), up_to(x, CAP - 1))
    full = _join(exactly(_chunk(x), q), up_to(x, r))
    return f"({fewer} | {full})"


def between(x: str, lo: int, hi: int | None) -> str:
    """``x`` between ``lo`` and ``hi`` times (None: no maximum)."""
    rest = f"{x}*" if hi is None else up_to(x, hi - lo)
    return _join(exactly(x, lo), rest)


def repetition(
    item_rule: str,
    min_items: int,
    max_items: int | None,
    separator_rule: str | None = None,
    item_rule_is_literal: bool = False,
) -> str:
    """The converter's repetition builder (same arguments, same meaning), in x{m,n} form.
    ``item_rule_is_literal`` needs no special case: a literal is already one element."""
    del item_rule_is_literal
    if max_items is not None and max_items < min_items:
        raise ValueError(f"a repetition of at least {min_items} and at most {max_items} items")
    if separator_rule is None:
        return between(_atom(item_rule), min_items, max_items) or '""'
    if max_items == 0:
        return '""'
    first = _atom(item_rule)
    more = f"({separator_rule} {item_rule})"
    tail = between(more, max(0, min_items - 1), None if max_items is None else max_items - 1)
    seq = _join(first, tail)
    return f"({seq})?" if min_items == 0 else seq
