"""The conversations behind OpenAI Responses ids, for ``previous_response_id``.

The engine keeps no conversation of its own, only KV; a continuation is the stored turns
plus the new input, rendered again, and the session's cache supplies every token that did
not change. So a response is kept while its session is: a session released (the final
header, an erased slot) takes its responses with it, and beyond a bound on count and bytes
the least recently used go first. A response is found only by the tenant that made it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from polykv_api.limits import MAX_STORED_RESPONSE_BYTES, MAX_STORED_RESPONSES
from polykv_api.models import ChatMessage


@dataclass(frozen=True, slots=True)
class Stored:
    session_id: str
    history: tuple[ChatMessage, ...]  # every turn, the response's own last
    size: int  # characters of text it holds (its share of the byte bound)


def size_of(history: tuple[ChatMessage, ...]) -> int:
    return sum(len(m.text()) + sum(len(str(c)) for c in m.tool_calls or ()) for m in history)


class ResponseStore:
    """Bounded, least recently used first out. Loop thread only."""

    def __init__(
        self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_RESPONSE_BYTES
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, response_id: str, stored: Stored) -> None:
        if stored.size > self.max_bytes:
            return  # larger than the whole store: a continuation re-sends its input instead
        self._entries[(tenant, response_id)] = stored
        self._bytes += stored.size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size

    def get(self, tenant: str, response_id: str) -> Stored | None:
        found = self._entries.get((tenant, response_id))
        if found is not None:
            self._entries.move_to_end((tenant, response_id))
        return found

    def forget_session(self, tenant: str, session_id: str) -> int:
        """Drop the session's responses; returns how many."""
        gone = [
            k for k, v in self._entries.items() if k[0] == tenant and v.session_id == session_id
        ]
        for key in gone:
            self._bytes -= self._entries.pop(key).size
        return len(gone)
