"""Turn a stream of token bytes into text: UTF-8 reassembly and stop strings (pure).

A token may end in the middle of a multi-byte character, and a stop string may arrive split
over several tokens. Streaming clients must never see half a character nor the first half of
a stop string, so text that could still become either is held back until it is decided.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field


@dataclass(slots=True)
class TextAssembler:
    stops: list[str] = field(default_factory=list)
    text: str = ""
    stopping_word: str | None = None
    _emitted: int = 0
    _matchers: list[_StopMatcher] = field(default_factory=list)
    # "replace" only for bytes that can never be valid UTF-8; an unfinished character is
    # held by the incremental decoder until its next bytes arrive.
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to send.

        After a stop string is found ``stopping_word`` is set and ``text`` ends just before it.
        """
        if self.stopping_word is not None:
            return ""
        new = self._decoder.decode(piece)
        start = len(self.text)
        self.text += new
        if not self.stops:
            return self._take(len(self.text))
        if len(self._matchers) != len(self.stops):
            self._matchers = [_StopMatcher(w) for w in self.stops]
        # Each matcher reads only the new characters (amortized O(1) a character): a stop
        # can only end in them, and what may still become one is what the matchers hold.
        hit: tuple[int, str] | None = None
        for m in self._matchers:
            end = m.feed(new)
            if end is not None:
                pos = start + end - len(m.word)
                if hit is None or pos < hit[0]:
                    hit = (pos, m.word)
        if hit is not None:
            pos, word = hit
            self.text = self.text[:pos]
            self.stopping_word = word
            return self._take(len(self.text))
        held = max(m.state for m in self._matchers)
        return self._take(len(self.text) - held)

    def flush(self) -> str:
        """End of generation: release whatever was held back. Bytes of a character the
        generation stopped in the middle of are dropped (never sent as U+FFFD)."""
        self._decoder.reset()
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out


class _StopMatcher:
    """Knuth-Morris-Pratt over one stop string, its failure table grown only as far as a
    match has reached: ``state`` is the length of the longest prefix of ``word`` that ends
    the text so far, so a stop of any length costs nothing until the output resembles it."""

    __slots__ = ("_fail", "state", "word")

    def __init__(self, word: str) -> None:
        self.word = word
        self.state = 0
        self._fail = [0]  # _fail[i]: longest proper border of word[:i + 1]

    def _border(self, i: int) -> int:
        """_fail[i], computing the entries before it first (each once)."""
        word, fail = self.word, self._fail
        while len(fail) <= i:
            j = fail[-1]
            c = word[len(fail)]
            while j > 0 and word[j] != c:
                j = fail[j - 1]
            fail.append(j + 1 if word[j] == c else 0)
        return fail[i]

    def feed(self, text: str) -> int | None:
        """Advance over ``text``; the index in it just past the first complete match."""
        word, state = self.word, self.state
        for i, c in enumerate(text):
            while state > 0 and word[state] != c:
                state = self._border(state - 1)
            if word[state] == c:
                state += 1
                if state == len(word):
                    self.state = 0
                    return i + 1
        self.state = state
        return None
