"""Reads a flat package's imports as written (ast) and checks a layering over them: the
helpers behind the operator's and the router's layering tests.

A unit is a top-level module, or a subpackage as a whole, except the subpackages named in
``split``, whose modules are units of their own (``autoscale.aggregate``): a subpackage that
holds both pure and I/O modules. ``LayerRule`` names each unit's layer; a unit imports only
from its own layer or lower ones, and the imports form no cycle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Package:
    root: Path
    """The package's folder (``.../polykv_operator``)."""
    import_name: str = ""
    """The name absolute imports use; default: the folder's name."""
    split: frozenset[str] = frozenset()
    """Subpackages whose modules are units of their own."""

    @property
    def name(self) -> str:
        return self.import_name or self.root.name

    def files(self) -> list[Path]:
        return sorted(self.root.rglob("*.py"))

    def unit_of(self, path: Path) -> str:
        rel = path.relative_to(self.root)
        if len(rel.parts) > 1 and rel.parts[0] in self.split:
            return f"{rel.parts[0]}.{Path(rel.parts[1]).stem}"
        return rel.parts[0] if len(rel.parts) > 1 else rel.stem

    def _unit(self, base: list[str], names: list[str]) -> set[str]:
        """The units an import of `names` from the package path `base` reaches."""
        if base[0] not in self.split:
            return {base[0]}
        if len(base) > 1:
            return {f"{base[0]}.{base[1]}"}
        return {f"{base[0]}.{n}" for n in names} or {base[0]}

    def imports(self, path: Path) -> tuple[set[str], set[str]]:
        """(units of this package that ``path`` imports, outside top-level packages)."""
        tree = ast.parse(path.read_text())
        here = path.relative_to(self.root).parent.parts  # () for a top-level module
        inside: set[str] = set()
        outside: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")
                    if top[0] == self.name:
                        inside |= self._unit(top[1:], []) if len(top) > 1 else {"__init__"}
                    else:
                        outside.add(top[0])
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0:
                    parts = (node.module or "").split(".")
                    if parts[0] != self.name:
                        outside.add(parts[0])
                        continue
                    base: list[str] = parts[1:]
                else:
                    up = len(here) - (node.level - 1)
                    assert up >= 0, f"{path}: relative import above the package"
                    base = [b for b in [*here[:up], *(node.module or "").split(".")] if b]
                names = [alias.name for alias in node.names]
                if base:
                    inside |= self._unit(base, names)
                else:  # from . import a, b
                    for name in names:
                        inside |= self._unit([name], [])
        return inside, outside

    def graph(self) -> dict[str, set[str]]:
        """unit -> the other units it imports (the package's own __init__ left out)."""
        out: dict[str, set[str]] = {}
        for path in self.files():
            if path.name == "__init__.py" and (
                path.parent == self.root or path.parent.name in self.split
            ):
                continue
            unit = self.unit_of(path)
            out.setdefault(unit, set()).update(u for u in self.imports(path)[0] if u != unit)
        return out


@dataclass(frozen=True)
class LayerRule:
    layers: dict[str, int]
    names: dict[int, str]

    def upward(self, g: dict[str, set[str]]) -> list[str]:
        return [
            f"{unit} ({self.names[self.layers[unit]]}) imports {dep} "
            f"({self.names[self.layers[dep]]})"
            for unit, deps in sorted(g.items())
            for dep in sorted(deps)
            if dep in self.layers and self.layers[dep] > self.layers[unit]
        ]


def cycles(g: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found: list[str] = []

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for dep in sorted(g.get(unit, ())):
            if state.get(dep) == 1:
                found.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[unit] = 2

    for unit in sorted(g):
        if unit not in state:
            visit(unit, [unit])
    return found
