"""Speculative decoding's drafts from the context itself (pure: prompt lookup, no model).

Agents repeat what their context holds: a tool call echoes arguments it was given, a code
edit rewrites most of a file it read, a summary quotes. So the tokens that followed the last
time the current n-gram appeared in the session's context are a cheap guess at what comes
next. The engine verifies the guess in the same step as the session's next token (each
drafted token gets logits; the sampler keeps drafted tokens while it picks them, exactly as
it would have one step at a time), so a right guess gives several tokens for one step and a
wrong one costs the drafted tokens' share of the step.

``NgramIndex`` keeps, for each n-gram size, the latest position each n-gram ended at; a token
appended costs a dictionary store per size, and a draft a lookup per size (longest first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

NGRAM_MAX = 4  # the longest match tried first
NGRAM_MIN = 2  # a single repeated token predicts too little to be worth drafting


@dataclass(slots=True)
class NgramIndex:
    """A session's tokens, and where each n-gram last ended (before the current end)."""

    tokens: list[int] = field(default_factory=list)
    _seen: list[dict[tuple[int, ...], int]] = field(
        default_factory=lambda: [{} for _ in range(NGRAM_MAX + 1)]
    )

    def extend(self, tokens: Iterable[int]) -> None:
        toks = self.tokens
        for tok in tokens:
            # The n-grams ending at the current last token get a known continuation now.
            end = len(toks) - 1
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end + 1 >= n:
                    self._seen[n][tuple(toks[end + 1 - n : end + 1])] = end
            toks.append(tok)

    def draft(self, n_max: int) -> list[int]:
        """Up to ``n_max`` tokens that followed the longest n-gram ending the context, the
        last time it appeared; [] when none repeats."""
        toks = self.tokens
        if n_max <= 0:
            return []
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(toks) < n:
                continue
            end = self._seen[n].get(tuple(toks[-n:]))
            if end is not None:
                return toks[end + 1 : end + 1 + n_max]
        return []


DRAFT_START = 4  # tokens drafted at the start of a turn
MAX_COOLDOWN = 16  # most steps drafting pauses after guesses that all missed


@dataclass(slots=True)
class Speculation:
    """One turn's speculation: the context's n-grams, how long the next draft may be, and
    what was drafted and kept.

    The draft length follows the acceptance: a draft kept whole doubles it (up to
    ``n_max``), one cut short sets it to what was kept plus one, and one missed from its
    first token pauses drafting for a number of steps that doubles with each such miss in a
    row. Verifying a drafted token costs its share of the step, so on text that does not
    repeat itself (plain prose) drafting soon stops costing anything."""

    n_max: int
    n_min: int = 0
    model: bool = False  # drafts come from the draft model, not the context's n-grams
    index: NgramIndex = field(default_factory=NgramIndex)
    drafted: int = 0
    accepted: int = 0
    _next: int = DRAFT_START
    _cooldown: int = 0
    _pause: int = 0

    def length(self, room: int) -> int:
        """How many tokens to draft now, at most ``room`` (what the context and the request
        allow); 0 while drafting pauses."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return max(0, min(self._next, self.n_max, room))

    def worth(self, draft: list[int]) -> list[int]:
        """The draft, or none when it is shorter than ``n_min``."""
        return draft if len(draft) >= max(self.n_min, 1) else []

    def propose(self, room: int) -> list[int]:
        """A draft from the context of at most ``room`` tokens."""
        return self.worth(self.index.draft(self.length(room)))

    def verified(self, drafted: int, kept: int) -> None:
        self.drafted += drafted
        self.accepted += kept
        if kept == drafted:
            self._next = min(self.n_max, self._next * 2)
            self._cooldown = 0
        elif kept > 0:
            self._next = kept + 1
            self._cooldown = 0
        else:
            self._next = 1
            self._cooldown = min(MAX_COOLDOWN, max(1, self._cooldown * 2))
            self._pause = self._cooldown
