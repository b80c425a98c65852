"""Every value in values.schema.json has a rejection case: a wrong value at that path makes
`helm template` (the same validation `helm install` runs) fail and name the field.

The cases are derived from the schema itself, so a value added to the chart gets its case
without anyone writing it: a leaf gets a value of the wrong type (or outside its enum or
range), an object an unknown key. One helm run checks all of them together (the validator
reports every error, each with its JSON pointer); a few cases also run alone.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from .chart import CHART, helm

SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())

# Minimal valid objects under the lists whose items are CR specs.
BASE: dict[str, Any] = {
    "engines": [{"name": "e", "spec": {"model": {"path": "/models/m.gguf"}}}],
    "pools": [{"name": "p", "spec": {"engineRef": {"name": "e"}, "text": "hello"}}],
    "admissionPolicies": [
        {"name": "a", "spec": {"poolRefs": [{"name": "p"}], "targetTpsPerSession": 5}}
    ],
    "imagePullSecrets": [{"name": "pull"}],
    "networkPolicy": {"apiServer": {"cidrs": ["10.0.0.1/32"]}},
    "operator": {"watchNamespaces": ["agents"]},
    "autoscaling": {"engines": [{"name": "e"}]},
}


@dataclass(frozen=True)
class Case:
    pointer: str  # the JSON pointer helm names, e.g. /operator/replicas
    path: tuple[str | int, ...]
    bad: Any

    @property
    def id(self) -> str:
        return self.pointer


def bad_leaf(node: dict[str, Any]) -> Any:
    """A value this schema node refuses."""
    if "enum" in node:
        return "surely-not-a-choice"
    types = node.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if types & {"integer", "number"} and "minimum" in node:
        return node["minimum"] - 1
    if types & {"integer", "number"} and "exclusiveMinimum" in node:
        return node["exclusiveMinimum"]
    if "string" in types and "pattern" in node:
        return "Not A Valid Value!"
    if "string" in types and node.get("minLength", 0) > 0:
        return ""
    if "string" in types or types & {"integer", "number"}:
        return {"an": "object"} if "string" in types else "a string"
    if "boolean" in types:
        return "yes"
    if "array" in types:
        return "not a list"
    return 12345


def value_at(values: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        values = values[key]
    return values


def cases(node: dict[str, Any], path: tuple[str | int, ...] = ()) -> Iterator[Case]:
    pointer = "/" + "/".join(str(p) for p in path)
    props = node.get("properties")
    if props is not None:
        if node.get("additionalProperties") is False:
            yield Case(f"{pointer.rstrip('/')}/bogusField", (*path, "bogusField"), "x")
        for key, child in props.items():
            yield from cases(child, (*path, key))
        return
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        items = node["items"]
        if "properties" in items:
            # Arrays of objects: the cases of their first item (BASE provides one).
            yield from cases(items, (*path, 0))
            return
        # Arrays of scalars: a bad first item (its pointer names the array too).
        if items.get("type") or items.get("enum"):
            yield Case(f"{pointer}/0", (*path, 0), bad_leaf(items))
        else:
            yield Case(pointer, path, bad_leaf(node))
        return
    extra = node.get("additionalProperties")
    if node.get("type") == "object" and isinstance(extra, dict):
        yield Case(f"{pointer}/bogusKey", (*path, "bogusKey"), bad_leaf(extra))
        return
    yield Case(pointer, path, bad_leaf(node))


def with_bad(values: dict[str, Any], case: Case) -> dict[str, Any]:
    out = copy.deepcopy(values)
    target = out
    for i, key in enumerate(case.path[:-1]):
        nxt = case.path[i + 1]
        if isinstance(target, list):
            while len(target) <= int(key):
                target.append({})
            target = target[int(key)]
            continue
        if key not in target or not isinstance(target[key], dict | list):
            target[key] = [] if isinstance(nxt, int) else {}
        target = target[key]
    last = case.path[-1]
    if isinstance(target, list):
        while len(target) <= int(last):
            target.append(None)
        target[int(last)] = case.bad
    else:
        target[last] = case.bad
    return out


CASES = [c for c in cases(SCHEMA) if c.path]


def expected_error(pointer: str) -> str:
    """How helm names the field: the JSON pointer, or the parent for an unknown key."""
    if pointer.endswith("/bogusField"):
        return f"at '{pointer.removesuffix('/bogusField')}': additional properties 'bogusField'"
    return f"at '{pointer}'"


def render(values: dict[str, Any], tmp: Path) -> subprocess.CompletedProcess[str]:
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return helm("template", "t", str(CHART), "-f", str(path), check=False)


@pytest.fixture(scope="module")
def all_at_once(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One helm run with every bad value in place (paths are disjoint leaves)."""
    values = copy.deepcopy(BASE)
    for case in CASES:
        values = with_bad(values, case)
    out = render(values, tmp_path_factory.mktemp("bad"))
    assert out.returncode != 0
    return out.stderr


def test_the_base_values_are_valid(tmp_path: Path) -> None:
    out = render(BASE, tmp_path)
    assert out.returncode == 0, out.stderr


def test_every_value_has_a_case() -> None:
    # Spot checks that the walk reaches the corners of the schema.
    pointers = {c.pointer for c in CASES}
    for expected in (
        "/operator/replicas",
        "/masterKey/existingSecret",
        "/networkPolicy/apiServer/cidrs/0",
        "/engines/0/spec/model/path",
        "/pools/0/spec/messages/0/role",
        "/admissionPolicies/0/spec/mode",
        "/tests/timeoutSeconds",
        "/bogusField",
    ):
        assert expected in pointers, expected
    assert len(CASES) > 100


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_value_is_refused_naming_its_field(case: Case, all_at_once: str) -> None:
    assert expected_error(case.pointer) in all_at_once, all_at_once[-3000:]


@pytest.mark.parametrize(
    "pointer",
    ["/operator/replicas", "/engines/0/spec/replicas", "/podSecurity/runAsUser", "/bogusField"],
)
def test_alone_it_fails_too(pointer: str, tmp_path: Path) -> None:
    case = next(c for c in CASES if c.pointer == pointer)
    out = render(with_bad(BASE, case), tmp_path)
    assert out.returncode != 0
    assert expected_error(pointer) in out.stderr, out.stderr
