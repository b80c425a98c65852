"""The PolyKV signals a completion response carries in its headers, typed.

OpenAI clients drop body fields they do not know, so the engine repeats what an agent needs
in headers on every completion response (on the first response of a stream too). Any HTTP
client can read them: ``Signals.from_headers(response.headers)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, Field

N = TypeVar("N", int, float)

SESSION_ID = "x-session-id"
"""Request header keying a session: send a stable one on every turn of a conversation, or an
enforced pool judges each turn a new session (and may refuse it)."""


class Signals(BaseModel):
    """What one completion response said about its session and pool. A field is None when
    the response did not carry it (no pool attached, or an engine without that header)."""

    session_id: str | None = Field(None, description="the session the turn ran in")
    pool_id: int | None = Field(None, description="the pool the session is attached to")
    cached_prefix_tokens: int | None = Field(
        None, description="prompt tokens shared from the pool's cells"
    )
    session_tps: float | None = Field(
        None, description="experienced decode tokens/s (at a stream's start: the last turn's)"
    )
    ctx_headroom: int | None = Field(None, description="tokens left in the session's context")
    compaction_pressure: float | None = Field(
        None, description="0..1: how close the KV cache is to full; compact before 1"
    )
    sessions_remaining: int | None = Field(
        None,
        description="backpressure: set when an enforced warn-mode pool admitted this session "
        "over its floor; how many more sessions it has room for",
    )
    pool_fallback: str | None = Field(
        None, description="why the request ran without its pool (the pool could not be used)"
    )

    @property
    def backpressure(self) -> bool:
        """The engine admitted this session over its pool's floor (warn mode)."""
        return self.sessions_remaining is not None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Signals:
        """Read the signals from response headers (any capitalisation)."""
        low = {k.lower(): v for k, v in headers.items()}
        return cls(
            session_id=low.get(SESSION_ID),
            pool_id=_num(int, low.get("x-pool-id")),
            cached_prefix_tokens=_num(int, low.get("x-cached-prefix-tokens")),
            session_tps=_num(float, low.get("x-session-tps")),
            ctx_headroom=_num(int, low.get("x-polykv-ctx-headroom")),
            compaction_pressure=_num(float, low.get("x-polykv-compaction-pressure")),
            sessions_remaining=_num(int, low.get("x-sessions-remaining")),
            pool_fallback=low.get("x-pool-fallback"),
        )


def _num(kind: type[N], raw: str | None) -> N | None:
    if raw is None:
        return None
    try:
        return kind(raw)
    except ValueError:
        return None
