"""Runs the chart's Argo CD health check (files/argocd/health.lua) the way Argo CD does:
Lua 5.1 (Argo CD embeds gopher-lua, a 5.1 interpreter; lupa.lua51 is the reference one),
the object as the global `obj`, the returned table's `status` and `message`. And the real
kstatus library (e2e/kstatus, built by scripts/build-kstatus.sh) on the same objects."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "helm" / "polykv" / "files" / "argocd" / "health.lua"
FIXTURES = Path(__file__).parent / "fixtures" / "status_objects.json"

# The state of each captured object -> (Argo CD health, kstatus status).
EXPECTED = {
    "ready-engine": ("Healthy", "Current"),
    "ready-pool": ("Healthy", "Current"),
    "ready-policy": ("Healthy", "Current"),
    "reconciling-pool": ("Progressing", "InProgress"),
    "stalled-pool": ("Degraded", "Failed"),
    "suspended-engine": ("Suspended", "Current"),
    "stale-generation-engine": ("Progressing", "InProgress"),
    "deleting-pool": ("Progressing", "Terminating"),
    # kstatus cannot tell a custom object nobody has looked at from a finished one.
    "no-status-pool": ("Progressing", "Current"),
}


def _to_lua(rt: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return rt.table_from({k: _to_lua(rt, v) for k, v in value.items()})
    if isinstance(value, list):
        return rt.table_from([_to_lua(rt, v) for v in value])
    return value


def argocd_health(obj: dict[str, Any], script: Path = SCRIPT) -> tuple[str, str]:
    from lupa import lua51

    rt = lua51.LuaRuntime(unpack_returned_tuples=True)
    rt.globals().obj = _to_lua(rt, obj)
    hs = rt.execute(script.read_text())
    return str(hs["status"]), str(hs["message"])


@functools.cache
def kstatus_binary() -> str:
    out = subprocess.run(
        [str(ROOT / "scripts" / "build-kstatus.sh")],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return out.stdout.strip().splitlines()[-1]


def kstatus(objs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    out = subprocess.run(
        [kstatus_binary()], input=json.dumps(objs), capture_output=True, text=True, check=True
    )
    return [(v["status"], v["message"]) for v in json.loads(out.stdout)]
