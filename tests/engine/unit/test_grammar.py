"""JSON Schema to grammar: integer ranges enforced exactly, enums as tries, unenforceable
keywords refused."""

from __future__ import annotations

import json
import re

import pytest

from polykv_engine.llama.gbnf import shape
from polykv_engine.llama.grammar import GrammarError, enum_rules, from_schema, int_range

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


_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|[A-Za-z0-9-]+|[()|]')


def enum_strings(rules: list[str]) -> set[str]:
    """Every string the trie rules match (the form ``enum_rules`` writes:
    ``name ::= ["prefix"] (alternative | ...)``, each alternative a literal or a rule)."""
    table = dict(rule.split(" ::= ", 1) for rule in rules)

    def expand(name: str) -> set[str]:
        tokens = [t for t in _TOKEN.findall(table[name]) if t not in ("(", ")", "|", "space")]
        prefix = ""
        if table[name].startswith('"'):
            prefix = json.loads(tokens.pop(0))
        out: set[str] = set()
        for t in tokens:
            out |= (
                {prefix + json.loads(t)} if t.startswith('"') else {prefix + s for s in expand(t)}
            )
        return out

    return expand(rules[0].split(" ::= ", 1)[0])


@pytest.mark.parametrize(
    "values",
    [
        ["red", "green", "grey", "gr", "g", ""],
        [f"value-{i}" for i in range(1000)],
        [1, 1.5, -1, None, True, {"a": 'b"c\\d'}, ["x\ny"], "1"],
        ["only"],
    ],
)
def test_an_enum_is_a_trie_matching_exactly_its_values(values: list[object]) -> None:
    texts = [json.dumps(v) for v in values]
    rules = enum_rules("enum-0", texts)
    assert enum_strings(rules) == set(texts)
    assert rules[0].endswith(" space")
    # alternatives at any point begin with different characters: few parse stacks
    assert (
        shape("\n".join(["root ::= enum-0", 'space ::= " "?', *rules]), 10**6, 10**8).fanout <= 20
    )


def test_a_schema_enum_becomes_a_trie_and_its_values_stay_data() -> None:
    gbnf = from_schema({"type": "object", "properties": {
        "c": {"enum": [f"v{i}" for i in range(500)]},
        "k": {"const": {"not": 1, "minimum": "x"}},  # values, not schema keywords
    }})  # fmt: skip
    assert "enum-0 ::=" in gbnf and "__polykv" not in gbnf
    assert shape(gbnf, 10**6, 10**8).fanout < 50
