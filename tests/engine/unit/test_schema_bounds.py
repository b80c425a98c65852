"""Schema bounds checked before conversion: counts, pattern quantifiers, depth, size."""

from __future__ import annotations

import re
from typing import Any

import pytest

from polykv_api.limits import MAX_SCHEMA_BYTES, MAX_SCHEMA_COUNT, MAX_SCHEMA_DEPTH
from polykv_engine.llama.schema_bounds import SchemaBoundError, check_schema


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "string", "maxLength": MAX_SCHEMA_COUNT + 1}, ".maxLength: 1000001 is over"),
        ({"type": "array", "minItems": 10**30}, ".minItems:"),
        ({"type": "string", "minLength": -1}, "non-negative integer"),
        ({"type": "string", "maxLength": 5.5}, "non-negative integer"),
        ({"type": "string", "maxLength": True}, "non-negative integer"),
        ({"properties": {"a": {"type": "string", "pattern": "a{0,2000000}"}}},
         ".properties.a.pattern: the quantifier {0,2000000}"),
        ({"type": "string", "pattern": "x{" + "9" * 5000 + "}"}, ".pattern: the quantifier"),
        ({"type": "string", "pattern": 5}, ".pattern: must be a string"),
        (nested(MAX_SCHEMA_DEPTH + 1), "nested deeper than the limit of 64"),
        ({"enum": ["x" * MAX_SCHEMA_BYTES]}, f"the limit is {MAX_SCHEMA_BYTES}"),
    ],
)  # fmt: skip
def test_past_a_bound_is_refused_by_path(schema: dict[str, Any], needle: str) -> None:
    with pytest.raises(SchemaBoundError, match=re.escape(needle)):
        check_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": MAX_SCHEMA_COUNT, "minLength": 50_000},
        {"type": "string", "pattern": "^[a-z]{0,100000}$"},
        nested(MAX_SCHEMA_DEPTH),
        # a property named like a keyword, and keywords inside data, are not counts
        {"type": "object", "properties": {"maxLength": {"type": "string"}}},
        {"enum": [{"maxLength": "not a count"}], "default": {"minItems": -3}},
        {"$defs": {"minItems": {"type": "integer"}}, "$ref": "#/$defs/minItems"},
    ],
)
def test_within_the_bounds_passes(schema: dict[str, Any]) -> None:
    check_schema(schema)


def test_a_schema_nested_far_past_the_limit_is_refused_without_recursing() -> None:
    schema: dict[str, Any] = {}
    for _ in range(100_000):
        schema = {"items": schema}
    with pytest.raises(SchemaBoundError, match="nested deeper"):
        check_schema(schema)
