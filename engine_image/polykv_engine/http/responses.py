"""Response bodies in llama-server's native and OpenAI shapes (pure builders).

Field names follow llama-server (native ``/completion``) and the OpenAI API (``/v1/*``) so
existing clients parse them unchanged; ``timings`` is the polykv_api ``Timings`` model.
A chat request with tools gets its output parsed into ``tool_calls`` (whole, or streamed as
``delta.tool_calls``); a request for log-probabilities gets them in each API's own shape.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from polykv_api.models import Timings
from polykv_engine.chat.tools import ArgsDelta, CallStart, ContentDelta, Delta, ToolCallParser
from polykv_engine.core.tasks import GenerateTask, GenerationResult, TokenEvent
from polykv_engine.http.errors import ApiError
from polykv_engine.http.sse import Payload
from polykv_engine.llama.runtime import TokenLogprobs

Route = Literal["completion", "oai_completion", "oai_chat"]
Piece = Callable[[int], bytes]  # a token's bytes


def timings(r: GenerationResult) -> Timings:
    def per_second(n: int, ms: float) -> float:
        return n / ms * 1e3 if ms > 0 else 0.0

    return Timings(
        prompt_n=r.prompt_n,
        prompt_ms=r.prompt_ms,
        prompt_per_token_ms=r.prompt_ms / r.prompt_n if r.prompt_n else 0.0,
        prompt_per_second=per_second(r.prompt_n, r.prompt_ms),
        predicted_n=r.predicted_n,
        predicted_ms=r.predicted_ms,
        predicted_per_token_ms=r.predicted_ms / r.predicted_n if r.predicted_n else 0.0,
        predicted_per_second=per_second(r.predicted_n, r.predicted_ms),
        cache_n=r.cache_n,
        draft_n=r.draft_n if r.draft_n else None,  # only when the turn drafted (llama-server)
        draft_n_accepted=r.draft_n_accepted if r.draft_n else None,
    )


def finish_reason(r: GenerationResult, tool_calls: bool = False) -> str:
    """As llama-server and OpenAI: a reply cut by max_tokens is "length" even when it
    holds calls, whose arguments may then be unfinished JSON."""
    if r.stop_type == "limit":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(r: GenerationResult) -> dict[str, Any]:
    return {
        "prompt_tokens": r.n_prompt_tokens,
        "completion_tokens": r.predicted_n,
        "total_tokens": r.n_prompt_tokens + r.predicted_n,
        "prompt_tokens_details": {"cached_tokens": r.cache_n},
    }


def _polykv(r: GenerationResult) -> dict[str, Any]:
    return {
        "session_id": r.session_id,
        "slot": r.slot,
        "tps_ewma": r.tps_ewma,
        "pool_id": r.pool_id,
        "shared_prefix_tokens": r.shared_prefix,
    }


class Logprobs:
    """Per-token log-probabilities rendered in the three APIs' shapes."""

    def __init__(self, piece: Piece) -> None:
        self.piece = piece
        self.entries: list[TokenLogprobs] = []
        self.offset = 0  # characters before the next token (legacy completions' text_offset)

    def _text(self, token: int) -> tuple[str, list[int]]:
        raw = self.piece(token)
        return raw.decode("utf-8", "replace"), list(raw)

    def openai_chat(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        def one(token: int, lp: float) -> dict[str, Any]:
            text, raw = self._text(token)
            return {"token": text, "logprob": lp, "bytes": raw}

        return {
            "content": [
                {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                for e in entries
            ]
        }

    def openai_completion(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, offsets = [], []
        for e in entries:
            text, _ = self._text(e.token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._text(t)[0]: lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def native(self, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        def one(token: int, lp: float) -> dict[str, Any]:
            text, raw = self._text(token)
            return {"id": token, "token": text, "bytes": raw, "logprob": lp}

        return [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]


class ResponseBuilder:
    """Builds the bodies of one completion request, streamed or not (an ``sse.Wire``)."""

    keepalive = b": keep-alive\n\n"

    def __init__(
        self,
        route: Route,
        model: str,
        prompt_text: str | None = None,
        tools: ToolCallParser | None = None,
        logprobs: Logprobs | None = None,
    ) -> None:
        self.route = route
        self.model = model
        self.operation = "chat" if route == "oai_chat" else "text_completion"
        self.created = int(time.time())
        prefix = "chatcmpl" if route == "oai_chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.prompt_text = prompt_text
        self.tools = tools
        self.logprobs = logprobs
        self.n_chunks = 0
        self._pending: list[TokenLogprobs] = []  # logprobs not yet sent with a chunk

    # ------------------------------------------------------------------ whole responses

    def final(self, r: GenerationResult, events: list[TokenEvent]) -> dict[str, Any]:
        content = "".join(e.text for e in events)
        probs = [e.logprobs for e in events if e.logprobs is not None]
        if self.route == "completion":
            body = self._native_final(r, content, stream=False)
            if self.logprobs is not None:
                body["completion_probabilities"] = self.logprobs.native(probs)
            return body
        if self.route == "oai_completion":
            text = (self.prompt_text or "") + content if self.prompt_text is not None else content
            choice: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": self.logprobs.openai_completion(probs) if self.logprobs else None,
                "finish_reason": finish_reason(r),
            }
            obj = "text_completion"
        else:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            calls = False
            if self.tools is not None:
                self.tools.feed(content)
                self.tools.finish()
                calls = bool(self.tools.calls)
                message["content"] = self.tools.content or (None if calls else "")
                if calls:
                    message["tool_calls"] = [c.openai() for c in self.tools.calls]
            choice = {
                "index": 0,
                "message": message,
                "logprobs": self.logprobs.openai_chat(probs) if self.logprobs else None,
                "finish_reason": finish_reason(r, calls),
            }
            obj = "chat.completion"
        return {
            **self._envelope(obj, [choice]),
            "usage": usage(r),
            "timings": timings(r).model_dump(exclude_none=True),
            "polykv": _polykv(r),
        }

    def _native_final(self, r: GenerationResult, content: str, stream: bool) -> dict[str, Any]:
        return {
            "index": 0,
            "content": content,
            "tokens": [] if stream else r.tokens,
            "id_slot": r.slot,
            "stop": True,
            "model": self.model,
            "tokens_predicted": r.predicted_n,
            "tokens_evaluated": r.n_prompt_tokens,
            "generation_settings": {"seed": r.seed},
            "has_new_line": "\n" in content,
            "truncated": r.truncated,
            "stop_type": r.stop_type,
            "stopping_word": r.stopping_word,
            "tokens_cached": r.n_prompt_tokens + r.predicted_n,
            "timings": timings(r).model_dump(exclude_none=True),
            "session_id": r.session_id,
            "polykv": _polykv(r),
        }

    # ------------------------------------------------------------------ stream chunks

    def stream_start(self, task: GenerateTask) -> list[Payload]:
        return []

    def stream_tail(self, r: GenerationResult | None, include_usage: bool) -> list[Payload]:
        if self.route == "completion":
            return []
        usage_chunk: list[Payload] = [self.usage_chunk(r)] if include_usage and r else []
        return [*usage_chunk, "[DONE]"]

    def stream_error(self, err: ApiError) -> list[Payload]:
        return [err.body()]

    def chunks(self, ev: TokenEvent) -> list[Payload]:
        """What one engine event becomes on the wire (often one chunk, sometimes none)."""
        if ev.logprobs is not None:
            self._pending.append(ev.logprobs)
        if self.route == "completion":
            chunk: dict[str, Any] = {
                "index": 0,
                "content": ev.text,
                "tokens": [ev.token] if ev.token >= 0 else [],
                "stop": False,
                "id_slot": -1,
            }
            if self.logprobs is not None:
                chunk["completion_probabilities"] = self.logprobs.native(self._take())
            return [chunk]
        if self.route == "oai_completion":
            if not ev.text:
                return []
            probs = self.logprobs.openai_completion(self._take()) if self.logprobs else None
            choice = {"index": 0, "text": ev.text, "logprobs": probs, "finish_reason": None}
            return [self._oai_chunk(choice)]
        deltas: list[Delta] = (
            self.tools.feed(ev.text) if self.tools is not None else [ContentDelta(ev.text)]
        )
        return self._chat_chunks(deltas)

    def _take(self) -> list[TokenLogprobs]:
        out, self._pending = self._pending, []
        return out

    def _chat_chunks(self, deltas: list[Delta]) -> list[Payload]:
        delta: dict[str, Any] = {}
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        if content:
            delta["content"] = content
        calls = []
        for d in deltas:
            if isinstance(d, CallStart):
                c = d.call
                calls.append(
                    {
                        "index": c.index,
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                )
            elif isinstance(d, ArgsDelta):
                calls.append({"index": d.index, "function": {"arguments": d.text}})
        if calls:
            delta["tool_calls"] = calls
        if not delta:
            return []
        self.n_chunks += 1
        if self.n_chunks == 1:
            delta = {"role": "assistant", **delta}
            delta.setdefault("content", None if calls else "")
        probs = self.logprobs.openai_chat(self._take()) if self.logprobs else None
        return [
            self._oai_chunk({"index": 0, "delta": delta, "logprobs": probs, "finish_reason": None})
        ]

    def stream_final(self, r: GenerationResult) -> list[Payload]:
        """The closing chunk(s): what the parser still held, the finish reason, timings."""
        if self.route == "completion":
            return [self._native_final(r, "", stream=True)]
        out: list[Payload] = []
        calls = False
        if self.route == "oai_completion":
            rest = self.logprobs.openai_completion(self._take()) if self.logprobs else None
            choice: dict[str, Any] = {
                "index": 0,
                "text": "",
                "logprobs": rest if rest and rest["tokens"] else None,
                "finish_reason": finish_reason(r),
            }
        else:
            if self.tools is not None:
                out += self._chat_chunks(self.tools.finish())
                calls = bool(self.tools.calls)
            delta: dict[str, Any] = {} if self.n_chunks else {"role": "assistant", "content": ""}
            rest_chat = self.logprobs.openai_chat(self._take()) if self.logprobs else None
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": rest_chat if rest_chat and rest_chat["content"] else None,
                "finish_reason": finish_reason(r, calls),
            }
        last = self._oai_chunk(choice)
        last["timings"] = timings(r).model_dump(exclude_none=True)
        last["polykv"] = _polykv(r)
        return [*out, last]

    def usage_chunk(self, r: GenerationResult) -> dict[str, Any]:
        out = self._oai_chunk(None)
        out["choices"] = []
        out["usage"] = usage(r)
        return out

    def _oai_chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.route == "oai_chat" else "text_completion"
        return self._envelope(obj, [choice] if choice is not None else [])

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "polykv",
            "choices": choices,
        }
