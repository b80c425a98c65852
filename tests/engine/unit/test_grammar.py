"""JSON Schema to grammar: integer ranges enforced exactly, unenforceable keywords refused."""

from __future__ import annotations

import re

import pytest

from polykv_engine.llama.grammar import GrammarError, from_schema, int_range

RANGES = [
    (0, 130), (5, 5), (-20, 7), (-130, -5), (None, 10), (3, None), (None, -4), (-7, None),
    (17, 2345), (0, 9), (10, 99), (None, None), (100, 1000),
]  # fmt: skip


def as_regex(expr: str) -> re.Pattern[str]:
    """The GBNF subset int_range emits (literals, classes, {n,}) as a Python regex."""
    rx = expr.replace('" (', "(").replace('"', "").replace(" ", "")
    return re.compile(f"^({rx})$")


@pytest.mark.parametrize(("lo", "hi"), RANGES)
def test_integer_ranges_match_exactly_the_integers_in_range(lo: int | None, hi: int | None) -> None:
    rx = as_regex(int_range(lo, hi))
    for n in range(-2500, 2500):
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert bool(rx.match(str(n))) == inside, n
    for not_json in ("01", "-0", "00", "-01", "+1"):
        assert not rx.match(not_json)


def test_bounds_become_range_rules() -> None:
    gbnf = from_schema({"type": "integer", "exclusiveMinimum": 0, "maximum": 3})
    assert "int-range-0 ::=" in gbnf and "__polykv" not in gbnf


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"x": {"not": {}}}}, ".properties.x: not"),
        ({"type": "number", "minimum": 0.5}, "integers only"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"),
    ],
)
def test_unenforceable_schemas_are_refused(schema: dict[str, object], needle: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(needle)):
        from_schema(schema)
