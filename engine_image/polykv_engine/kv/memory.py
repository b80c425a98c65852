"""What a model keeps per sequence, and the rules pools follow on it (pure).

- attention: every layer keeps every token's cells. A pool's cells are shared by position
  range, at any length.
- sliding_window: some layers attend to the last ``n_swa`` tokens only, and llama.cpp hands a
  cell that one sequence alone holds to the next token once it is out of that sequence's
  window. A pool's cells are decoded into a guard sequence too, so two sequences always hold
  them and none is handed out; the window layers then need a full-size cache (``swa_full``).
  A session's cells are shared (automatic sharing) where they are still whole: once two
  sequences hold them, they are not handed out either.
- recurrent: one fixed-size state per sequence, exact only after its last token. A pool is
  attached at exactly its length (the state is copied into the session's sequence), a fork
  must extend its parent, and nothing is cut back below the end.
- hybrid: a recurrent state and attention cells: the recurrent rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

MemoryKind = Literal["attention", "sliding_window", "recurrent", "hybrid"]

SWA_CACHE_PAD = 256  # llama.cpp pads a window-sized SWA cache to this many cells


@dataclass(frozen=True, slots=True)
class Memory:
    kind: MemoryKind
    n_swa: int = 0  # the window, in tokens

    @classmethod
    def of(cls, recurrent: bool, hybrid: bool, n_swa: int) -> Memory:
        if recurrent:
            return cls("recurrent")
        if hybrid:
            return cls("hybrid", n_swa)
        return cls("sliding_window", n_swa) if n_swa > 0 else cls("attention")

    @property
    def exact_length(self) -> bool:
        """A sequence's memory is exact only at its end: attach at exactly L, forks extend,
        a cached context is reused whole or not at all."""
        return self.kind in ("recurrent", "hybrid")

    @property
    def guarded(self) -> bool:
        """Pools' cells need a guard sequence to stay whole."""
        return self.kind == "sliding_window"

    @property
    def plain(self) -> bool:
        """Cells can be shared, moved and cut by position range at will."""
        return self.kind == "attention"

    def pools_summary(self) -> str:
        if self.kind == "attention":
            return "pools share the prefix's cells copy-free, attach and branch at any length"
        if self.kind == "sliding_window":
            return (
                f"a {self.n_swa}-token sliding window: every pool's cells are also held by a "
                "guard sequence, so llama.cpp never recycles them, and the window layers keep "
                "a full-size cache; attach and branch at any length"
            )
        return (
            "the recurrent state exists only at the end of a prefix: a session attaches at "
            "exactly a pool's length (its prompt must go on past it), a child pool extends "
            "its parent (branch_pos = the parent's length), anything shorter is refused "
            "(recurrent_attach, recurrent_branch)"
        )


def window_cache_cells(n_ctx: int, n_swa: int, n_seq_max: int, n_ubatch: int, unified: bool) -> int:
    """Cells llama.cpp gives a window-sized SWA cache (without --swa-full)."""
    cells = min(n_ctx, n_swa * (n_seq_max if unified else 1) + n_ubatch)
    return -(-cells // SWA_CACHE_PAD) * SWA_CACHE_PAD


def swa_full_cost(
    n_ctx: int, n_swa: int, n_seq_max: int, n_ubatch: int, unified: bool, swa_bytes_per_token: int
) -> int:
    """Bytes a full-size SWA cache takes beyond the window-sized one llama.cpp would make."""
    window = window_cache_cells(n_ctx, n_swa, n_seq_max, n_ubatch, unified)
    return max(0, n_ctx - window) * swa_bytes_per_token


def window_kept(cells_from: int, pos: int, n_swa: int) -> bool:
    """On a sliding-window model: whether a sequence whose window layers hold its positions
    from ``cells_from`` on still holds the window the token at ``pos`` sees,
    ``[pos - n_swa + 1, pos)``. llama.cpp keeps each sequence's positions in the window
    cache one unbroken run, ``[pos_min, pos_max]``: a cell it hands out takes every position
    below it along, so ``cells_from`` (``pos_min``) says exactly what is left."""
    return n_swa <= 0 or cells_from <= max(0, pos - n_swa + 1)


def window_joins(cells_from: int, keep: int, reuse: int, n_swa: int) -> bool:
    """Whether positions [keep, reuse) can be shared from a sequence whose window layers
    hold its positions from ``cells_from`` on, by one that holds [0, keep) with its window
    (nothing when ``keep`` is 0): the receiver's run must stay unbroken and hold the window
    before ``reuse``."""
    if keep > 0:
        return cells_from <= keep
    return window_kept(cells_from, reuse, n_swa)


def save_spans(p0: int, p1: int, n_swa: int) -> list[tuple[int, int]]:
    """How to save positions [p0, p1) so that llama.cpp writes every cell: its writer leaves
    out the window layers' cells that the sequence's last token no longer sees, so on a
    sliding-window model a range is saved a window at a time (spans that start on a
    multiple of the window: whole chunks for chunked attention too). One span elsewhere."""
    if p1 <= p0:
        return []
    if n_swa <= 0:
        return [(p0, p1)]
    cuts = range((p0 // n_swa + 1) * n_swa, p1, n_swa)
    return list(pairwise([p0, *cuts, p1]))
