"""The router's layering (polykv_router/__init__.py, router/README.md), on its imports.

Layers, bottom up: pure <- I/O <- use case <- entry. Only the I/O layer and above touch the
network (aiohttp) or Prometheus; the router never imports the engine or the operator, so its
image carries neither llama.cpp nor kopf.
"""

from __future__ import annotations

from pathlib import Path

from ..layering import LayerRule, Package, cycles

ROUTER = Package(Path(__file__).resolve().parents[2] / "router" / "polykv_router")
PURE = (
    "names", "request", "errors", "pods", "picker", "fleet", "bindings", "reservations",
    "verdicts",
)  # fmt: skip
RULE = LayerRule(
    {
        **dict.fromkeys((*PURE, "config"), 0),
        **dict.fromkeys(("logs", "metrics", "engines", "kube", "capacity", "proxy", "keycheck"), 1),
        "routing": 2,
        **dict.fromkeys(("app", "cli"), 3),
    },
    {0: "pure", 1: "I/O", 2: "use case", 3: "entry"},
)


def test_every_module_has_a_layer() -> None:
    assert set(ROUTER.graph()) == set(RULE.layers), (
        "give the new module a layer (and a README line)"
    )


def test_no_module_imports_upwards_and_there_is_no_cycle() -> None:
    g = ROUTER.graph()
    assert RULE.upward(g) == []
    assert cycles(g) == []


def test_the_pure_layer_does_no_io() -> None:
    io = {"aiohttp", "prometheus_client", "asyncio", "socket", "ssl", "httpx", "multidict"}
    found = {
        f"{p.name}: {sorted(mods & io)}"
        for p in ROUTER.files()
        if RULE.layers.get(ROUTER.unit_of(p)) == 0 and (mods := ROUTER.imports(p)[1]) & io
    }
    assert found == set()


def test_the_router_needs_neither_the_engine_nor_the_operator() -> None:
    outside = set().union(*(ROUTER.imports(p)[1] for p in ROUTER.files()))
    assert not outside & {"polykv_engine", "polykv_operator", "llama_cpp", "kopf", "kubernetes"}
