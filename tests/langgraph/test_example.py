"""examples/agents/crew.py runs to the end on a real engine: two rounds of a planner and two
workers on one pool tree, spawns gated by the engine's capacity, one compaction, and every
pool it made released."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from polykv_client import PolyKVClient
from polykv_engine.testing import EngineProcess

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # about 30 s on 2 cores

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents" / "crew.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crew_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_crew_example_runs_to_the_end(smol: EngineProcess, pools: PolyKVClient) -> None:
    crew = load()
    # --compact-below just under an 8k context's headroom after round one: compaction shows.
    args = crew.parse(["--engine", smol.base_url, "--workers", "2", "--rounds", "2",
                       "--compact-below", "8150", "--thread", "example"])  # fmt: skip
    out = crew.run(smol.base_url, None, args)
    assert out["round"] == 2 and len(out["results"]) == 4
    assert out["compactions"] == 1 and out["pool_id"].startswith("planner-c-")
    assert out["capacity_ok"] is True and out["headroom_sessions"] >= 1
    assert pools.list_pools().pools == []  # the tree was released, compaction pool included
