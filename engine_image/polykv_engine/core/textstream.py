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
        self.text += self._decoder.decode(piece)
        if self.stops:
            longest = max(len(s) for s in self.stops)
            search_from = max(0, self._emitted - longest)
            hit = self._first_stop(search_from)
            if hit is not None:
                pos, word = hit
                self.text = self.text[:pos]
                self.stopping_word = word
                return self._take(len(self.text))
            return self._take(len(self.text) - self._partial_stop_len())
        return self._take(len(self.text))

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

    def _first_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for word in self.stops:
            pos = self.text.find(word, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, word)
        return best

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        best = 0
        for word in self.stops:
            for n in range(min(len(word) - 1, len(self.text)), best, -1):
                if self.text.endswith(word[:n]):
                    best = n
                    break
        return best
