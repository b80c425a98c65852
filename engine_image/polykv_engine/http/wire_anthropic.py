"""Anthropic Messages bodies: the whole ``message`` and its event stream (an ``sse.Wire``).

The stream is Anthropic's documented sequence: ``message_start``, ``ping``, then per
content block ``content_block_start`` / ``content_block_delta`` (``text_delta`` or
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason and the
final usage) and ``message_stop``; ``ping`` again as the keep-alive, ``error`` for a failure
after the headers went out.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from polykv_engine.chat.anthropic import stop_reason, tool_input
from polykv_engine.chat.tools import ArgsDelta, CallStart, ContentDelta, Delta, ToolCallParser
from polykv_engine.core.tasks import GenerateTask, GenerationResult, TokenEvent
from polykv_engine.http.errors import ApiError, anthropic_error
from polykv_engine.http.kept_prefix import KeptPart
from polykv_engine.http.sse import Named, Payload, frame

Block = Literal["text", "tool_use"]


def usage(n_prompt: int, cached: int, output: int, kept: KeptPart) -> dict[str, int]:
    """Read: prompt tokens KV supplied that were not computed for this request; creation:
    the kept prefix's tokens computed now; input: the rest (past the breakpoint, or not
    kept). The three input figures add up to the prompt's length."""
    read = max(0, cached - kept.computed)
    creation = max(0, min(kept.length, n_prompt) - read)
    return {
        "input_tokens": n_prompt - read - creation,
        "output_tokens": output,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
    }


class MessagesWire:
    keepalive = frame(Named("ping", {"type": "ping"}))
    operation = "chat"

    def __init__(
        self, model: str, tools: ToolCallParser | None, kept: KeptPart, task: GenerateTask
    ) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.tools = tools
        self._kept = kept
        self._task = task
        self._open: Block | None = None  # the content block being streamed
        self._index = -1

    @property
    def kept(self) -> KeptPart:
        return self._kept.held(self._task)

    def _usage(self, r: GenerationResult) -> dict[str, int]:
        return usage(r.n_prompt_tokens, r.cache_n, r.predicted_n, self.kept)

    def _whole_text(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.tools is None:
            return text, []
        self.tools.feed(text)
        self.tools.finish()
        calls = [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)}
            for c in self.tools.calls
        ]
        return self.tools.content, calls

    def final(self, r: GenerationResult, events: list[TokenEvent]) -> dict[str, Any]:
        text, calls = self._whole_text("".join(e.text for e in events))
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        content += calls
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content or [{"type": "text", "text": ""}],
            "stop_reason": stop_reason(r.stop_type, bool(calls)),
            "stop_sequence": r.stopping_word if r.stop_type == "word" else None,
            "usage": self._usage(r),
        }

    # ------------------------------------------------------------------ streaming

    def stream_start(self, task: GenerateTask) -> list[Payload]:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(len(task.prompt), task.n_cached, 0, self.kept),
        }
        return [
            Named("message_start", {"type": "message_start", "message": message}),
            Named("ping", {"type": "ping"}),
        ]

    def _start(self, block: Block, content_block: dict[str, Any]) -> list[Payload]:
        out = self._stop()
        self._open, self._index = block, self._index + 1
        start = {"type": "content_block_start", "index": self._index}
        return [*out, Named("content_block_start", {**start, "content_block": content_block})]

    def _stop(self) -> list[Payload]:
        if self._open is None:
            return []
        self._open = None
        return [Named("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _delta(self, delta: dict[str, Any]) -> Payload:
        body = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return Named("content_block_delta", body)

    def _events(self, deltas: list[Delta]) -> list[Payload]:
        out: list[Payload] = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                if not d.text:
                    continue
                if self._open != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d.text}))
            elif isinstance(d, CallStart):
                block = {"type": "tool_use", "id": d.call.id, "name": d.call.name, "input": {}}
                out += self._start("tool_use", block)  # its arguments follow as ArgsDelta
            elif isinstance(d, ArgsDelta):
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.text}))
        return out

    def chunks(self, ev: TokenEvent) -> list[Payload]:
        if self.tools is None:
            return self._events([ContentDelta(ev.text)])
        return self._events(self.tools.feed(ev.text))

    def stream_final(self, r: GenerationResult) -> list[Payload]:
        out = self._events(self.tools.finish()) if self.tools is not None else []
        if self._index < 0:  # nothing was said: one empty text block, as the whole body has
            out += self._start("text", {"type": "text", "text": ""})
        out += self._stop()
        calls = self.tools is not None and bool(self.tools.calls)
        delta = {
            "stop_reason": stop_reason(r.stop_type, calls),
            "stop_sequence": r.stopping_word if r.stop_type == "word" else None,
        }
        end = {"type": "message_delta", "delta": delta, "usage": self._usage(r)}
        return [*out, Named("message_delta", end), Named("message_stop", {"type": "message_stop"})]

    def stream_tail(self, r: GenerationResult | None, include_usage: bool) -> list[Payload]:
        return []

    def stream_error(self, err: ApiError) -> list[Payload]:
        return [Named("error", anthropic_error(err))]
