"""OpenAI Responses bodies: the whole ``response`` and its event stream (an ``sse.Wire``).

Streamed: ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta`` ... ``response.output_text.done``,
``response.content_part.done``, for a function call
``response.function_call_arguments.delta`` ... ``.done``, then
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``
when ``max_output_tokens`` cut it). Every event carries its ``sequence_number``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from polykv_api.models import ChatMessage
from polykv_api.openai_responses import ResponsesRequest
from polykv_engine.chat.openai_responses import qualified, split_name
from polykv_engine.chat.tools import ArgsDelta, CallStart, ContentDelta, Delta, ToolCallParser
from polykv_engine.chat.turns import function_call
from polykv_engine.core.tasks import GenerateTask, GenerationResult, TokenEvent
from polykv_engine.http.errors import ApiError
from polykv_engine.http.kept_prefix import KeptPart
from polykv_engine.http.sse import Named, Payload


def usage(n_prompt: int, cached: int, output: int, kept: KeptPart) -> dict[str, Any]:
    """Every computed prompt token is kept in the session's cache: written, in OpenAI's
    words; ``cached_tokens`` came from KV (a kept prefix, a pool, the session's own cache,
    or another of the tenant's sequences) and were not computed for this request."""
    read = max(0, cached - kept.computed)
    return {
        "input_tokens": n_prompt,
        "input_tokens_details": {"cached_tokens": read, "cache_write_tokens": n_prompt - read},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n_prompt + output,
    }


class ResponsesWire:
    keepalive = b": keep-alive\n\n"
    operation = "chat"

    def __init__(
        self,
        response_id: str,
        model: str,
        req: ResponsesRequest,
        tools: ToolCallParser | None,
        on_done: Callable[[ChatMessage], None],
        task: GenerateTask,
        kept: KeptPart,
    ) -> None:
        self.id = response_id
        self._task = task
        self._kept = kept
        self.model = model
        self.req = req
        self.tools = tools
        self.on_done = on_done  # called with the assistant's turn before the last bytes go
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []  # output items, the open one last
        self._open = False
        self._seq = 0

    # ------------------------------------------------------------------ bodies

    def _usage(self, r: GenerationResult) -> dict[str, Any]:
        return usage(r.n_prompt_tokens, r.cache_n, r.predicted_n, self._kept.held(self._task))

    def response(self, status: str, r: GenerationResult | None = None) -> dict[str, Any]:
        req = self.req
        cut = r is not None and r.stop_type == "limit"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if cut else status,
            "model": self.model,
            "output": self.items,
            "usage": self._usage(r) if r else None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "previous_response_id": req.previous_response_id,
            "instructions": req.instructions,
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "error": None,
        }

    def _done(self, r: GenerationResult) -> None:
        status = "incomplete" if r.stop_type == "limit" else "completed"
        for item in self.items:
            item["status"] = status
        text = "".join(
            part["text"] for i in self.items if i["type"] == "message" for part in i["content"]
        )
        calls = [
            function_call(i["call_id"], qualified(i["name"], i.get("namespace")), i["arguments"])
            for i in self.items
            if i["type"] == "function_call"
        ]
        self.on_done(ChatMessage(role="assistant", content=text or None, tool_calls=calls or None))

    def final(self, r: GenerationResult, events: list[TokenEvent]) -> dict[str, Any]:
        self._apply(self._deltas("".join(e.text for e in events), final=True))
        self._close()
        self._done(r)
        return self.response("completed", r)

    # ------------------------------------------------------------------ streaming

    def _event(self, kind: str, **fields: Any) -> Named:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return Named(kind, body)

    def _deltas(self, text: str, final: bool = False) -> list[Delta]:
        if self.tools is None:
            return [ContentDelta(text)]
        out = self.tools.feed(text)
        return [*out, *self.tools.finish()] if final else out

    def _where(self) -> dict[str, Any]:
        item = self.items[-1]
        return {"item_id": item["id"], "output_index": len(self.items) - 1}

    def _open_item(self, item: dict[str, Any]) -> list[Payload]:
        out = self._close()
        self.items.append(item)
        self._open = True
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        where = len(self.items) - 1
        out.append(self._event("response.output_item.added", output_index=where, item=added))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(
                self._event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        return out

    def _close(self) -> list[Payload]:
        if not self._open:
            return []
        self._open = False
        item = self.items[-1]
        out: list[Payload] = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self._event(
                    "response.output_text.done",
                    **self._where(),
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                self._event(
                    "response.content_part.done", **self._where(), content_index=0, part=part
                )
            )
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **self._where(),
                    arguments=item["arguments"],
                )
            )
        done = {**item, "status": "completed"}
        out.append(
            self._event("response.output_item.done", output_index=len(self.items) - 1, item=done)
        )
        return out

    def _apply(self, deltas: list[Delta]) -> list[Payload]:
        out: list[Payload] = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                if not d.text:
                    continue
                if not (self._open and self.items[-1]["type"] == "message"):
                    part = {"type": "output_text", "text": "", "annotations": []}
                    out += self._open_item(
                        {
                            "id": f"msg_{uuid.uuid4().hex}",
                            "type": "message",
                            "role": "assistant",
                            "status": "in_progress",
                            "content": [part],
                        }
                    )
                self.items[-1]["content"][0]["text"] += d.text
                out.append(
                    self._event(
                        "response.output_text.delta",
                        **self._where(),
                        content_index=0,
                        delta=d.text,
                        logprobs=[],
                    )
                )
            elif isinstance(d, CallStart):
                name, namespace = split_name(d.call.name)
                item = {
                    "id": f"fc_{uuid.uuid4().hex}",
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": d.call.id,
                    "name": name,
                    "arguments": "",
                }
                if namespace is not None:
                    item["namespace"] = namespace
                out += self._open_item(item)
            elif isinstance(d, ArgsDelta):
                self.items[-1]["arguments"] += d.text
                out.append(
                    self._event(
                        "response.function_call_arguments.delta", **self._where(), delta=d.text
                    )
                )
        return out

    def stream_start(self, task: GenerateTask) -> list[Payload]:
        pending = self.response("in_progress")
        return [
            self._event("response.created", response=pending),
            self._event("response.in_progress", response=pending),
        ]

    def chunks(self, ev: TokenEvent) -> list[Payload]:
        return self._apply(self._deltas(ev.text))

    def stream_final(self, r: GenerationResult) -> list[Payload]:
        out = self._apply(self.tools.finish()) if self.tools is not None else []
        out += self._close()
        self._done(r)
        body = self.response("completed", r)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=body)]

    def stream_tail(self, r: GenerationResult | None, include_usage: bool) -> list[Payload]:
        return []

    def stream_error(self, err: ApiError) -> list[Payload]:
        return [self._event("error", code=err.reason, message=err.message, param=None)]
