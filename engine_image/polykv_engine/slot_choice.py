"""Which slot serves a waiting request (pure policy; the engine applies it).

Order of preference, as a demanding agent framework expects:
1. a request whose session is bound to a slot goes back to that slot (its KV is there) and
   waits for it if that slot is busy;
2. an explicit ``id_slot`` waits for that slot;
3. otherwise an idle slot no session owns (another session's cache is its next turn's
   speed-up: taken only when nothing else is free, least recently used first), then the one
   whose cached tokens share the longest prefix with the prompt (llama-server's prompt-cache
   reuse), then the least recently used one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotView:
    slot_id: int
    idle: bool
    session_id: str | None
    cache_tokens: Sequence[int]
    last_used: float


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def choose_slot(
    slots: Sequence[SlotView],
    prompt: Sequence[int],
    session_slot: int | None,
    id_slot: int,
    cache_prompt: bool,
) -> int | None:
    """The slot to use now, or None when the request must keep waiting."""
    if session_slot is not None:
        return session_slot if slots[session_slot].idle else None
    if id_slot >= 0:
        return id_slot if slots[id_slot].idle else None
    best: tuple[bool, int, float] | None = None
    chosen: int | None = None
    for s in slots:
        if not s.idle:
            continue
        free = s.session_id is None
        lcp = common_prefix_len(s.cache_tokens, prompt) if cache_prompt and free else 0
        key = (free, lcp, -s.last_used)
        if best is None or key > best:
            best, chosen = key, s.slot_id
    return chosen
