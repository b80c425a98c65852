"""x{m,n} repetitions for the schema converter: every count exact, no count over the cap."""

from __future__ import annotations

import re

import pytest

from polykv_engine.llama.repetition import CAP, repetition

COUNTS = [
    (0, 1), (1, None), (0, None), (3, 7), (0, CAP), (0, CAP + 1), (0, 100_000), (499, 1001),
    (1000, 1000), (CAP * CAP + 1, CAP * CAP + 1), (0, 999_999), (7, 1_000_000), (2000, None),
]  # fmt: skip


def as_regex(expr: str) -> re.Pattern[str]:
    """The GBNF the builder writes for literal items, as a Python regex."""
    return re.compile("^(?:" + expr.replace('"', "").replace(" ", "") + ")$")


def lengths_to_check(lo: int, hi: int | None) -> set[int]:
    top = hi if hi is not None else lo + 2 * CAP
    near = [0, lo, top, CAP, 2 * CAP, CAP * CAP]
    return {n for c in near for n in range(max(0, c - 3), c + 4)} | set(range(0, 3 * CAP, 7))


@pytest.mark.parametrize(("lo", "hi"), COUNTS)
def test_counts_are_exact(lo: int, hi: int | None) -> None:
    rx = as_regex(repetition('"a"', lo, hi))
    for n in lengths_to_check(lo, hi):
        assert bool(rx.match("a" * n)) == (n >= lo and (hi is None or n <= hi)), n


@pytest.mark.parametrize(("lo", "hi"), [(0, None), (1, None), (0, 1), (2, 5), (0, 1200), (3, 3)])
def test_counts_with_a_separator_are_exact(lo: int, hi: int | None) -> None:
    rx = as_regex(repetition('"a"', lo, hi, separator_rule='","'))
    for n in range(0, 1300):
        assert bool(rx.match(",".join(["a"] * n))) == (n >= lo and (hi is None or n <= hi)), n


@pytest.mark.parametrize(("lo", "hi"), COUNTS)
def test_no_count_passes_the_cap_and_nothing_nests_deep(lo: int, hi: int | None) -> None:
    """llama.cpp refuses a minimum over 2000 and reads a maximum over 2000 as unbounded; and
    the text stays short (the old builder wrote one nested group per count)."""
    expr = repetition("char", lo, hi)
    assert all(int(n) <= CAP for n in re.findall(r"\d+", expr))
    depth = max(expr[:i].count("(") - expr[:i].count(")") for i in range(len(expr) + 1))
    assert depth <= 8 and len(expr) < 400


def test_min_over_max_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 5 and at most 4"):
        repetition('"a"', 5, 4)
