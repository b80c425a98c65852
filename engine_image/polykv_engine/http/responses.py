"""Response bodies in llama-server's native and OpenAI shapes (pure builders).

Field names follow llama-server (native ``/completion``) and the OpenAI API (``/v1/*``) so
existing clients parse them unchanged; ``timings`` is the polykv_api ``Timings`` model.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from polykv_api.models import Timings
from polykv_engine.core.tasks import GenerationResult

Route = Literal["completion", "oai_completion", "oai_chat"]


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
    )


def finish_reason(r: GenerationResult) -> str:
    return "length" if r.stop_type == "limit" else "stop"


def _usage(r: GenerationResult) -> dict[str, Any]:
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


class ResponseBuilder:
    """Builds the bodies of one completion request, streamed or not."""

    def __init__(self, route: Route, model: str, prompt_text: str | None = None) -> None:
        self.route = route
        self.model = model
        self.created = int(time.time())
        prefix = "chatcmpl" if route == "oai_chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.prompt_text = prompt_text
        self.n_chunks = 0

    # ------------------------------------------------------------------ whole responses

    def final(self, r: GenerationResult, content: str) -> dict[str, Any]:
        if self.route == "completion":
            return self._native_final(r, content, stream=False)
        if self.route == "oai_completion":
            text = (self.prompt_text or "") + content if self.prompt_text is not None else content
            choice: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason(r),
            }
            obj = "text_completion"
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": None,
                "finish_reason": finish_reason(r),
            }
            obj = "chat.completion"
        return {
            **self._envelope(obj, [choice]),
            "usage": _usage(r),
            "timings": timings(r).model_dump(),
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
            "timings": timings(r).model_dump(),
            "session_id": r.session_id,
            "polykv": _polykv(r),
        }

    # ------------------------------------------------------------------ stream chunks

    def chunk(self, text: str, token: int) -> dict[str, Any] | None:
        """One streamed piece, or None when there is nothing worth sending."""
        if self.route == "completion":
            return {
                "index": 0,
                "content": text,
                "tokens": [token] if token >= 0 else [],
                "stop": False,
                "id_slot": -1,
            }
        if not text:
            return None
        self.n_chunks += 1
        if self.route == "oai_completion":
            return self._oai_chunk(
                {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
            )
        delta: dict[str, Any] = {"content": text}
        if self.n_chunks == 1:
            delta["role"] = "assistant"
        return self._oai_chunk(
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        )

    def stream_final(self, r: GenerationResult) -> list[dict[str, Any]]:
        """The closing chunk(s): finish reason, timings, and usage when asked for."""
        if self.route == "completion":
            return [self._native_final(r, "", stream=True)]
        if self.route == "oai_completion":
            choice: dict[str, Any] = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": finish_reason(r),
            }
        else:
            delta: dict[str, Any] = {} if self.n_chunks else {"role": "assistant", "content": ""}
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason(r),
            }
        last = self._oai_chunk(choice)
        last["timings"] = timings(r).model_dump()
        last["polykv"] = _polykv(r)
        return [last]

    def usage_chunk(self, r: GenerationResult) -> dict[str, Any]:
        out = self._oai_chunk(None)
        out["choices"] = []
        out["usage"] = _usage(r)
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
