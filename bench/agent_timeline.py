"""What an agent run's streamed turns say about each session's experience (pure: no I/O).

A turn is the arrival times of its streamed tokens (seconds from the start of the run), and
the time its request was sent. Between its first and its last token a turn *decodes*; its
rate at an instant is one over the inter-token gap that instant falls in. Under a floor of F
tokens/s a session is under the floor for every gap longer than the floor period 1/F (the
whole gap: no token came in it), so a prompt that freezes decoding for 2 s costs every session
decoding at the time 2 s. The wait for a turn's first token (its own prompt, and any
admission wait) is its first-token time, not time under the floor: the floor is a decode rate.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TurnTimes:
    """One streamed turn: when it was sent and when each token arrived (run seconds)."""

    session: str
    sent: float
    tokens: tuple[float, ...]

    @property
    def first_token_s(self) -> float:
        return self.tokens[0] - self.sent

    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.tokens)]

    def under_floor_s(self, floor_tps: float) -> float:
        """Seconds of this turn's decoding spent in gaps longer than the floor period."""
        period = 1.0 / floor_tps
        return sum(g for g in self.gaps() if g > period)

    def largest_gap_s(self) -> float:
        return max(self.gaps(), default=0.0)

    def rate_at(self, t: float) -> float | None:
        """Tokens/s at instant ``t``: one over the gap it falls in; None outside decoding."""
        if len(self.tokens) < 2 or not self.tokens[0] <= t < self.tokens[-1]:
            return None
        i = bisect.bisect_right(self.tokens, t)  # tokens[i-1] <= t < tokens[i]
        gap = self.tokens[i] - self.tokens[i - 1]
        return 1.0 / gap if gap > 0 else None


def under_floor_by_session(turns: Sequence[TurnTimes], floor_tps: float) -> dict[str, float]:
    """Each session's seconds under the floor, summed over its turns."""
    out: dict[str, float] = {}
    for turn in turns:
        out[turn.session] = out.get(turn.session, 0.0) + turn.under_floor_s(floor_tps)
    return out


def mean_tps_series(
    turns: Sequence[TurnTimes], end_s: float, step_s: float
) -> list[tuple[float, float | None, int]]:
    """``(t, mean rate of the turns decoding at t, how many)`` every ``step_s`` from 0 to
    ``end_s``; the mean is None while nothing decodes."""
    if step_s <= 0:
        raise ValueError("step_s must be positive")
    out: list[tuple[float, float | None, int]] = []
    for k in range(math.floor(end_s / step_s) + 1):
        t = k * step_s
        rates = [r for r in (turn.rate_at(t) for turn in turns) if r is not None]
        out.append((round(t, 3), sum(rates) / len(rates) if rates else None, len(rates)))
    return out


def needs_compaction(context_tokens: int, first_prompt_tokens: int, budget_tokens: int) -> bool:
    """Whether a session's history is due for a summary: its context has grown more than
    ``budget_tokens`` past the prompt of its first turn (the shared prefix and first ask)."""
    return context_tokens - first_prompt_tokens > budget_tokens
