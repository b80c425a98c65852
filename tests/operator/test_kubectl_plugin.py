"""`kubectl polykv tree`: the drawing, from PolyKVPool objects as the API server returns them."""

from __future__ import annotations

from typing import Any

from polykv_operator.kubectl_plugin import human_bytes, render


def pool(
    name: str, parent: str | None = None, ready: str = "True", **status: Any
) -> dict[str, Any]:
    conditions = [
        {"type": "Ready", "status": ready, "reason": "Materialized" if ready == "True" else "X"},
        {"type": "Stalled", "status": "False", "reason": "Progressing"},
    ]
    return {
        "metadata": {"name": name, "namespace": "agents"},
        "spec": {"engineRef": {"name": "demo"}, **({"parent": parent} if parent else {})},
        "status": {"conditions": conditions, **status},
    }


def test_branch_lines_columns_and_order() -> None:
    pools = [
        pool("shell", "crew", prefixLen=212, branchPos=29, sessions=0, ownKvBytes=4_600_000),
        pool("crew", prefixLen=201, branchPos=0, sessions=0, ownKvBytes=5_100_000),
        pool("planner", "crew", prefixLen=239, branchPos=201, sessions=1, meanActiveTps=31.24),
        pool("step", "planner", ready="False", prefixLen=250, branchPos=239),
        pool("lost", "gone"),
    ]
    assert render(pools).splitlines() == [
        "POOL                         LEN   D     SESSIONS   TPS    KV        READY",
        "crew                         201   0     0          -      4.9 MiB   True",
        "├── planner                  239   201   1          31.2   -         True",
        "│   └── step                 250   239   -          -      -         False: X",
        "└── shell                    212   29    0          -      4.4 MiB   True",
        "lost (parent gone missing)   -     -     -          -      -         True",
    ]


def test_stalled_and_deleting_win_over_ready() -> None:
    stalled = pool("a")
    stalled["status"]["conditions"][1] = {
        "type": "Stalled",
        "status": "True",
        "reason": "ParentNotFound",
    }
    deleting = pool("b")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    out = render([stalled, deleting])
    assert "Stalled: ParentNotFound" in out and "Deleting" in out


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (None, 512, 2048, 5 * 1024**3)] == [
        "-",
        "512 B",
        "2.0 KiB",
        "5.0 GiB",
    ]
