"""Decode-rate measurement (pure: no llama_cpp, no clock of its own; callers pass times).

Two meters, because the spec asks two different questions:

* ``SessionRate`` — a session's *experienced* decode speed. It is an EWMA over the gaps
  between the session's own tokens, so a session that is waiting between turns keeps its last
  measured speed instead of decaying towards zero. The window is the shorter of
  ``window_tokens`` tokens or ``window_s`` seconds (default 128 tokens or 2 s): each new gap
  discounts the history by ``exp(-max(dt / window_s, 1 / window_tokens))``.
* ``ThroughputRate`` — system throughput (aggregate decode or prefill tokens/s). An
  exponentially decayed token count divided by its time constant, so it falls to zero when
  the engine goes idle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_WINDOW_TOKENS = 128
DEFAULT_WINDOW_S = 2.0


@dataclass(slots=True)
class SessionRate:
    """Experienced tokens/s of one session's current turn."""

    window_tokens: int = DEFAULT_WINDOW_TOKENS
    window_s: float = DEFAULT_WINDOW_S
    _tokens: float = 0.0
    _seconds: float = 0.0
    _last_t: float | None = None
    n_tokens: int = 0

    def reset(self) -> None:
        """Start a new turn: the previous turn's speed says little about this one."""
        self._tokens = 0.0
        self._seconds = 0.0
        self._last_t = None
        self.n_tokens = 0

    def on_token(self, t: float) -> None:
        """Record one token produced for this session at time ``t`` (seconds)."""
        self.n_tokens += 1
        if self._last_t is not None:
            dt = max(t - self._last_t, 0.0)
            decay = math.exp(-max(dt / self.window_s, 1.0 / self.window_tokens))
            self._tokens = self._tokens * decay + 1.0
            self._seconds = self._seconds * decay + dt
        self._last_t = t

    @property
    def tps(self) -> float:
        """0.0 until two tokens have been seen (the session is then still warming)."""
        if self._seconds <= 0.0:
            return 0.0
        return self._tokens / self._seconds

    @property
    def warming(self) -> bool:
        return self._seconds <= 0.0


@dataclass(slots=True)
class ThroughputRate:
    """Tokens/s across the engine, decaying to zero when idle."""

    tau_s: float = DEFAULT_WINDOW_S
    _decayed: float = 0.0
    _last_t: float | None = None
    total: int = field(default=0)

    def add(self, n: int, t: float) -> None:
        self._decay_to(t)
        self._decayed += n
        self.total += n

    def rate(self, t: float) -> float:
        self._decay_to(t)
        return self._decayed / self.tau_s

    def _decay_to(self, t: float) -> None:
        if self._last_t is not None and t > self._last_t:
            self._decayed *= math.exp(-(t - self._last_t) / self.tau_s)
        if self._last_t is None or t > self._last_t:
            self._last_t = t


@dataclass(frozen=True, slots=True)
class ActiveRates:
    """The one definition of mean_active_tps: the mean experienced decode rate over sessions
    that are decoding and already measured. Warming sessions (decoding, no rate yet) are
    counted apart, never averaged in as 0 tok/s. Replicas combine by the sums, not means."""

    n_active: int = 0
    n_warming: int = 0
    tps_sum: float = 0.0

    @property
    def mean(self) -> float:
        return self.tps_sum / self.n_active if self.n_active else 0.0

    def __add__(self, other: ActiveRates) -> ActiveRates:
        return ActiveRates(
            self.n_active + other.n_active,
            self.n_warming + other.n_warming,
            self.tps_sum + other.tps_sum,
        )


def active_rates(sessions: Iterable[tuple[bool, bool, float]]) -> ActiveRates:
    """From ``(decoding, warming, tps_ewma)`` per session."""
    n_active = n_warming = 0
    total = 0.0
    for decoding, warming, tps in sessions:
        if not decoding:
            continue
        if warming or tps <= 0.0:
            n_warming += 1
        else:
            n_active += 1
            total += tps
    return ActiveRates(n_active, n_warming, total)
