"""The engine's layering rule, checked on its imports: lower layers never import upward.

    http -> core -> pools -> kv -> llama | policy      (tokens and the wire contract below all)

Within a folder modules may import each other, but no module graph may have a cycle, and
only ``llama/`` may import ``llama_cpp``. ``polykv_modelgen`` (the model generator) and the
engine never import each other, so the server image needs no ``gguf``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "engine_image"

# unit -> rank; a unit may import only units of a lower rank (or itself).
RANKS = {
    "polykv_api": 0,
    "polykv_engine.tokens": 0,
    "polykv_engine.ids": 0,
    "polykv_engine.llama": 1,
    "polykv_engine.policy": 1,
    "polykv_engine.kv": 2,
    "polykv_engine.chat": 2,
    "polykv_engine.pools": 3,
    "polykv_engine.core": 4,
    "polykv_engine.http": 5,
    "polykv_engine.cli": 6,
    "polykv_engine.boot": 7,
    "polykv_engine.__main__": 8,
    "polykv_engine.testing": 6,
    "polykv_engine.fetch_model": 6,
    "polykv_engine": 0,  # the package __init__: the version string, nothing else
    "polykv_modelgen": 0,
    "polykv_client": 1,
}
OURS = ("polykv_api", "polykv_engine", "polykv_modelgen", "polykv_client")

Edge = tuple[str, str]  # (importing module, imported module)


def unit_of(module: str) -> str:
    best = ""
    for unit in RANKS:
        if (module == unit or module.startswith(unit + ".")) and len(unit) > len(best):
            best = unit
    if not best:
        raise AssertionError(f"{module} belongs to no layer: add it to RANKS")
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> Iterable[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            modules = []
            for alias in node.names:  # `from pkg import module` imports a module, not pkg
                candidate = f"{base}.{alias.name}"
                if any(
                    (ROOT / candidate.replace(".", "/")).with_suffix(s).exists()
                    for s in (".py", "")
                ):
                    modules.append(candidate)
            yield from modules
            if len(modules) < len(node.names):
                yield base


def edges() -> list[Edge]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        me = module_name(path)
        for target in imports_of(path):
            out.append((me, target))
    return out


def upward(all_edges: Iterable[Edge]) -> list[str]:
    """Every import of an equal or higher layer from another unit, as a readable line."""
    bad = []
    for src, dst in all_edges:
        if not dst.startswith(OURS):
            continue
        a, b = unit_of(src), unit_of(dst)
        if a != b and RANKS[b] >= RANKS[a]:
            bad.append(f"{src} imports {dst}: {a} (rank {RANKS[a]}) -> {b} (rank {RANKS[b]})")
        if a.startswith("polykv_modelgen") != b.startswith("polykv_modelgen"):
            bad.append(f"{src} imports {dst}: the engine and the model generator stay apart")
        if a.startswith("polykv_engine") and b == "polykv_client":
            bad.append(f"{src} imports {dst}: the engine serves the client, never uses it")
    return bad


def cycles(all_edges: Iterable[Edge]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for src, dst in all_edges:
        if dst.startswith(OURS) and src != dst:
            graph.setdefault(src, set()).add(dst)
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_module_imports_upward() -> None:
    assert upward(edges()) == []


def test_no_import_cycles() -> None:
    assert cycles(edges()) == []


def test_only_the_llama_folder_imports_llama_cpp() -> None:
    bad = [
        f"{src} imports {dst}"
        for src, dst in edges()
        if dst.split(".")[0] == "llama_cpp" and not src.startswith("polykv_engine.llama")
    ]
    assert bad == []


def test_the_engine_does_not_import_gguf() -> None:
    bad = [
        f"{src} imports {dst}"
        for src, dst in edges()
        if dst.split(".")[0] == "gguf" and not src.startswith("polykv_modelgen")
    ]
    assert bad == []


def test_the_checks_would_catch_a_violation() -> None:
    # The checker itself: an upward import and a two-module cycle are both reported.
    assert upward([("polykv_engine.kv.cache", "polykv_engine.core.engine")])
    assert upward([("polykv_engine.policy.tps", "polykv_engine.llama.runtime")])
    assert upward([("polykv_modelgen.cli", "polykv_api.models")])
    assert not upward([("polykv_engine.core.engine", "polykv_engine.kv.cache")])
    loop = [
        ("polykv_engine.core.a", "polykv_engine.core.b"),
        ("polykv_engine.core.b", "polykv_engine.core.a"),
    ]
    assert cycles(loop)
