"""Server-sent events: how one payload is framed, and what every streamed API builds.

Each API the engine speaks (llama-server's, OpenAI's chat and completions, OpenAI
Responses, Anthropic Messages) has a builder with the ``Wire`` face below; the inference
routes relay engine events through it, so queueing, keep-alives, cancellation and the
admission gate are written once for all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from polykv_engine.core.tasks import GenerateTask, GenerationResult, TokenEvent
    from polykv_engine.http.errors import ApiError


@dataclass(frozen=True, slots=True)
class Named:
    """An event with a name (``event:`` line): Anthropic's and OpenAI Responses' streams
    dispatch on it."""

    event: str
    data: dict[str, Any]


Payload = dict[str, Any] | str | Named

# Unicode line breaks that JSON leaves raw: SSE splits lines at CR and LF only, but many
# clients split at every Unicode line break (Python's str.splitlines, httpx's iter_lines),
# and a token carrying one would cut its event in two. Escaped, they decode the same.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def frame(payload: Payload) -> bytes:
    """One SSE event: ``data:`` with the JSON (a string as it is), after ``event:`` when
    the payload is named."""
    head = ""
    if isinstance(payload, Named):
        head, payload = f"event: {payload.event}\n", payload.data
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    if not data.isascii():
        data = data.translate(_LINE_BREAKS)
    return f"{head}data: {data}\n\n".encode()


class Wire(Protocol):
    """The bodies of one request in one API, whole or streamed."""

    keepalive: bytes  # sent on a stream that has had nothing to say for a while
    model: str  # the model name the answer reports
    operation: str  # GenAI semantic conventions: chat or text_completion

    def final(self, r: GenerationResult, events: list[TokenEvent]) -> dict[str, Any]:
        """The whole (not streamed) response body."""

    def stream_start(self, task: GenerateTask) -> list[Payload]:
        """Events before the first token (the task holds its slot by then)."""

    def chunks(self, ev: TokenEvent) -> list[Payload]:
        """What one engine event becomes (often one event, sometimes none)."""

    def stream_final(self, r: GenerationResult) -> list[Payload]:
        """The closing events: what a parser still held, the finish reason, usage."""

    def stream_tail(self, r: GenerationResult | None, include_usage: bool) -> list[Payload]:
        """After the closing events, or after an error (``r`` None)."""

    def stream_error(self, err: ApiError) -> list[Payload]:
        """An error after the headers went out."""
