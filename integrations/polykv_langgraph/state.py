"""Graph state for agents on PolyKV: the pool a thread attaches to and the live capacity
readings, with a reducer so several nodes may report in the same step."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from langgraph.graph import MessagesState

from polykv_api import models as wire

T = TypeVar("T")


def latest(left: T | None, right: T | None) -> T | None:
    """Keep the newest reading: the last one written wins, and a None keeps what was there.

    Capacity readings come from whichever node looked last (a gate before a spawn, a worker
    after its turn); several may report in one step, which a plain key refuses
    (``InvalidUpdateError``)."""
    return left if right is None else right


class PolyKVState(MessagesState, total=False):
    """``MessagesState`` plus what PolyKV routing reads. Extend it with your own keys."""

    pool_id: int | str
    """The pool this thread's turns attach to (a compaction moves it)."""
    compacted_pool: str | None
    """The pool this thread's last compaction made: its own, released at the next one."""
    compactions: int
    capacity_ok: Annotated[bool | None, latest]
    """The last capacity verdict for a new session in the thread's pool."""
    headroom_sessions: Annotated[int | None, latest]
    """How many more sessions the pool has room for (KV and free slots), at the last reading."""
    mean_active_tps: Annotated[float | None, latest]
    """The mean experienced decode tps of the engine's active sessions, at the last reading."""


def capacity_update(cap: wire.Capacity) -> dict[str, Any]:
    """The state update a capacity reading makes (for a gate, or any node that polls)."""
    return {
        "capacity_ok": cap.can_admit,
        "headroom_sessions": cap.headroom_sessions,
        "mean_active_tps": cap.mean_active_tps,
    }
