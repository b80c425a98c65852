"""The bounds a JSON schema must keep before it is turned into a grammar (pure).

Checked without recursion, so a schema nested past any limit is refused, not a stack
overflow; the converter runs only on schemas this accepts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from polykv_api.limits import MAX_SCHEMA_BYTES, MAX_SCHEMA_COUNT, MAX_SCHEMA_DEPTH

COUNT_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems")
# A regex quantifier {m}, {m,} or {m,n}; the converter reads the same three forms.
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


class SchemaBoundError(ValueError):
    """A schema past a bound; the message starts with the path of the offending part."""


def _check_count(path: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaBoundError(f"{path}.{key}: must be a non-negative integer")
    if value > MAX_SCHEMA_COUNT:
        raise SchemaBoundError(f"{path}.{key}: {value} is over the limit of {MAX_SCHEMA_COUNT}")


def _check_pattern(path: str, pattern: Any) -> None:
    if not isinstance(pattern, str):
        raise SchemaBoundError(f"{path}.pattern: must be a string")
    for m in _QUANTIFIER.finditer(pattern):
        for digits in m.groups():
            # Compared as text: a 5000-digit count is refused without making it an int.
            if digits and (len(digits) > 7 or int(digits) > MAX_SCHEMA_COUNT):
                raise SchemaBoundError(
                    f"{path}.pattern: the quantifier {m.group()} is over the limit of "
                    f"{MAX_SCHEMA_COUNT} repetitions"
                )


# Keywords whose value maps names to schemas, and keywords whose value is data, not schema.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_DATA = frozenset({"enum", "const", "default", "examples", "description", "title"})


def check_schema(schema: Mapping[str, Any]) -> None:
    """Raise SchemaBoundError unless ``schema`` keeps every bound in polykv_api.limits."""
    # (node, its path, its depth, whether it is a schema whose keywords count)
    stack: list[tuple[Any, str, int, bool]] = [(schema, "", 1, True)]
    while stack:
        node, path, depth, is_schema = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaBoundError(f"{path}: nested deeper than the limit of {MAX_SCHEMA_DEPTH}")
        if isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", depth + 1, is_schema) for i, v in enumerate(node))
            continue
        if is_schema:
            for key in COUNT_KEYWORDS:
                if key in node:
                    _check_count(path, key, node[key])
            if "pattern" in node:
                _check_pattern(path, node["pattern"])
        for k, v in node.items():
            if is_schema and k in _SCHEMA_MAPS and isinstance(v, dict):
                stack.extend((s, f"{path}.{k}.{n}", depth + 2, True) for n, s in v.items())
            else:
                stack.append((v, f"{path}.{k}", depth + 1, is_schema and k not in _DATA))
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise SchemaBoundError(f": {size} bytes, the limit is {MAX_SCHEMA_BYTES}")
