"""``CompactionNode``: compact a thread's context by re-forking its stable ancestor.

The engine never edits KV that pools share, so compaction is a rewrite of the prompt: when
the last reply's ``compaction_pressure`` reaches the threshold (or its context headroom falls
to ``min_headroom`` tokens), the node

1. summarizes the older messages with the thread's own session (its KV already holds them,
   so only the request to summarize is new prefill),
2. forks the stable ancestor pool (system prompt and tools, unchanged by compaction) with the
   summary as one more system message: a new pool, prefilled once,
3. moves the thread to it (``pool_id`` in state) and rewrites the messages to the new
   prefix's messages plus the recent tail, so the next turn's prompt starts with exactly the
   new pool's prefix and reuses it,
4. releases the pool the thread's previous compaction made, with anything below it. Only
   pools it made itself: a pool the thread merely attached to may serve other threads.

It pins nothing, so it leaves no orphaned pin; the engine pins the new pool while the
thread's session uses it. Put it before the agent node: ``compact -> agent -> ... ->
compact``. The state must hold the whole conversation, system messages included (the
stable ancestor's messages as the tree knows them).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
    convert_to_messages,
)
from langchain_core.runnables import RunnableConfig
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from polykv_client import Signals

from .chat_model import PolyKVChatModel, polykv_signals
from .tools import PoolTree

SUMMARY_REQUEST = (
    "Summarize the conversation so far in a few sentences: the task, what was decided and "
    "what is still open. Write only the summary."
)
SUMMARY_HEADER = "Summary of the conversation so far: "


class CompactionNode:
    """A LangGraph node compacting a thread by re-fork (see the module docstring).

    ``model`` summarizes (a ``PolyKVChatModel``; the thread's session); ``tree`` knows the
    ``ancestor``'s messages; ``threshold`` is on ``compaction_pressure`` (0..1),
    ``min_headroom`` on the session's context headroom in tokens; ``keep`` recent messages
    stay verbatim (the tail starts at a human message, never at an orphaned tool result)."""

    def __init__(
        self,
        model: PolyKVChatModel,
        tree: PoolTree,
        ancestor: str,
        *,
        threshold: float = 0.8,
        min_headroom: int | None = None,
        keep: int = 2,
        summary_tokens: int = 160,
        session_scope: str | None = None,
    ) -> None:
        self.model = model
        self.tree = tree
        self.ancestor = ancestor
        self.threshold = threshold
        self.min_headroom = min_headroom
        self.keep = keep
        self.summary_tokens = summary_tokens
        self.session_scope = session_scope

    def due(self, state: Mapping[str, Any]) -> Signals | None:
        """The last reply's signals when they call for compaction, else None."""
        last = next((m for m in reversed(state["messages"]) if isinstance(m, AIMessage)), None)
        signals = polykv_signals(last) if last is not None else None
        if signals is None:
            return None
        pressure = signals.compaction_pressure or 0.0
        low = (
            self.min_headroom is not None
            and signals.ctx_headroom is not None
            and signals.ctx_headroom <= self.min_headroom
        )
        return signals if pressure >= self.threshold or low else None

    def __call__(self, state: Mapping[str, Any], config: RunnableConfig) -> dict[str, Any]:
        if self.due(state) is None:
            return {}
        messages: list[AnyMessage] = list(state["messages"])
        prefix = self.tree.prefix(self.ancestor)
        head = len(prefix.messages)
        tail = _tail(messages[head:], self.keep)
        older = messages[: len(messages) - len(tail)]
        pool = state.get("pool_id", self.ancestor)
        summary = self._summarize(older, pool, config)
        name = f"{self.ancestor}-c-{uuid.uuid4().hex[:8]}"
        note = {"role": "system", "content": SUMMARY_HEADER + summary}
        self.tree.fork(self.ancestor, name, [note])
        previous = state.get("compacted_pool")
        if previous:
            self.tree.release(previous)
        rebuilt = [*_as_messages(prefix.messages), SystemMessage(note["content"]), *tail]
        return {
            "messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), *rebuilt],
            "pool_id": name,
            "compacted_pool": name,
            "compactions": int(state.get("compactions", 0)) + 1,
        }

    def _summarize(
        self, older: Sequence[AnyMessage], pool: int | str, config: RunnableConfig
    ) -> str:
        reply = self.model.invoke(
            [*older, HumanMessage(SUMMARY_REQUEST)],
            config,
            pool_id=pool,
            session_scope=self.session_scope,
            max_tokens=self.summary_tokens,
        )
        return str(reply.text).strip() or "(no summary)"


def _tail(messages: Sequence[AnyMessage], keep: int) -> list[AnyMessage]:
    """The last ``keep`` messages or more, starting at a human message (a tool result never
    leads the tail without the call that asked for it)."""
    start = max(0, len(messages) - keep)
    while start > 0 and not isinstance(messages[start], HumanMessage):
        start -= 1
    tail = list(messages[start:])
    while tail and isinstance(tail[0], ToolMessage | AIMessage):
        tail.pop(0)
    return tail


def _as_messages(dicts: Sequence[Mapping[str, Any]]) -> list[AnyMessage]:
    return list(convert_to_messages([dict(d) for d in dicts]))  # type: ignore[arg-type]
