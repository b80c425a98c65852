"""``CapacityGate``: a node that lets a new session into a pool only while the engine says
it fits, and otherwise waits (``interrupt``) or routes elsewhere.

It asks ``/capacity`` with the session the next node will use: a session the engine already
knows is a continuation and always passes (the engine never refuses one), so the gate can
stand before every turn and only new sessions are ever held. Unlike a rate limiter it sees
what the engine sees: the projected tps against the pool's floor, KV headroom, context
headroom (``expected_tokens``) and settling after the last admit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.types import Command, Send, interrupt

from polykv_api import models as wire
from polykv_client import PolyKVClient

from .chat_model import session_key
from .state import capacity_update

INTERRUPT = "interrupt"

Goto = str | Send | Sequence[str | Send]
GotoFn = Callable[[Mapping[str, Any], wire.Capacity], Goto]


class CapacityGate:
    """A LangGraph node: ``Command(update={capacity_ok, headroom_sessions, mean_active_tps},
    goto=...)``.

    * ``pool``: a pool ref, or None to read ``state["pool_id"]``.
    * ``goto``: the node to run when a session fits, or a function of (state, capacity)
      returning nodes or ``Send``s (e.g. one worker per free session).
    * ``on_full``: ``"interrupt"`` pauses the graph with the refusal (``{pool, reason,
      retry_after_s, headroom_sessions}``) until it is resumed (``Command(resume=...)``), then
      asks again, and pauses again while the pool is still full; a node name routes there
      instead. Interrupting needs a checkpointer.
    * ``session_scope``: as the chat model's, so the gate asks about the same session.
    """

    def __init__(
        self,
        client: PolyKVClient,
        goto: str | GotoFn,
        *,
        pool: wire.PoolRef | None = None,
        on_full: str = INTERRUPT,
        expected_tokens: int | None = None,
        session_scope: str | None = None,
    ) -> None:
        self.client = client
        self.goto = goto
        self.pool = pool
        self.on_full = on_full
        self.expected_tokens = expected_tokens
        self.session_scope = session_scope

    def check(
        self, state: Mapping[str, Any], config: RunnableConfig | None = None
    ) -> wire.Capacity:
        """The engine's verdict for this thread's session joining the pool now."""
        pool = self.pool if self.pool is not None else state["pool_id"]
        session = session_key(config, self.session_scope)
        return self.client.capacity(pool, self.expected_tokens, session_id=session)

    def __call__(self, state: Mapping[str, Any], config: RunnableConfig) -> Command[Any]:
        while True:
            cap = self.check(state, config)
            if cap.can_admit:
                goto = self.goto(state, cap) if callable(self.goto) else self.goto
                return Command(update=capacity_update(cap), goto=goto)
            if self.on_full != INTERRUPT:
                return Command(update=capacity_update(cap), goto=self.on_full)
            interrupt(refusal(cap, self.pool if self.pool is not None else state["pool_id"]))
            # Resumed: ask again (a node re-runs from its start on resume, and each
            # interrupt() already answered returns its resume value instead of pausing).


def refusal(cap: wire.Capacity, pool: wire.PoolRef) -> dict[str, Any]:
    """What an interrupted gate tells whoever resumes it."""
    wait = math.ceil(cap.settle_remaining_ms / 1e3) if cap.settling else None
    return {
        "pool": pool,
        "reason": cap.reason_code,
        "detail": cap.reason,
        "retry_after_s": wait,
        "headroom_sessions": cap.headroom_sessions,
    }
