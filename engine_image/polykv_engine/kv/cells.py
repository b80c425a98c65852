"""A shadow of the unified KV cache's cell membership (pure).

llama.cpp exposes no per-cell view, yet PolyKV must attribute every KV byte to exactly one
owner (a pool's own range or a session's private suffix). This model mirrors each memory
operation the engine performs: a sequence is a list of cell ids by position; ``copy`` makes
the destination share the source's cells (what ``llama_memory_seq_cp`` does in a unified
cache); a cell is freed when no sequence holds it any more. Tests compare ``used`` with
llama.cpp's own count of used cells, so the model is checked against reality.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable


class KVModel:
    def __init__(self) -> None:
        self._seqs: dict[int, list[int]] = {}
        self._refs: Counter[int] = Counter()
        self._ids = itertools.count()

    def cells(self, seq: int) -> list[int]:
        """Cell ids of ``seq`` by position (a copy)."""
        return list(self._seqs.get(seq, ()))

    def length(self, seq: int) -> int:
        return len(self._seqs.get(seq, ()))

    @property
    def used(self) -> int:
        return len(self._refs)

    def append(self, seq: int, n: int) -> None:
        """``n`` freshly computed tokens were decoded at the end of ``seq``."""
        new = [next(self._ids) for _ in range(n)]
        self._seqs.setdefault(seq, []).extend(new)
        self._refs.update(new)

    def copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``dst`` (which must end at ``p0``) gains ``src``'s cells for positions [p0, p1)."""
        dst_cells = self._seqs.setdefault(dst, [])
        if len(dst_cells) != p0:
            raise ValueError(f"seq {dst} has {len(dst_cells)} positions; copy must start there")
        shared = self._seqs.get(src, [])[p0:p1]
        if len(shared) != p1 - p0:
            raise ValueError(f"seq {src} does not hold positions [{p0}, {p1})")
        dst_cells.extend(shared)
        self._refs.update(shared)

    def replace(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``dst``'s positions [p0, p1) now hold ``src``'s cells there instead of its own."""
        dst_cells, src_cells = self._seqs.get(dst, []), self._seqs.get(src, [])
        if len(dst_cells) < p1 or len(src_cells) < p1:
            raise ValueError(f"seqs {src} and {dst} must both hold positions [{p0}, {p1})")
        self._release(dst_cells[p0:p1])
        dst_cells[p0:p1] = src_cells[p0:p1]
        self._refs.update(src_cells[p0:p1])

    def truncate(self, seq: int, pos: int) -> None:
        """Drop positions >= ``pos`` of ``seq``."""
        cells = self._seqs.get(seq)
        if not cells:
            return
        self._release(cells[pos:])
        del cells[pos:]

    def clear(self, seq: int) -> None:
        self.truncate(seq, 0)
        self._seqs.pop(seq, None)

    def remove_range(self, seq: int, p0: int, p1: int) -> None:
        """Drop [p0, p1) and shift later positions down (a context shift)."""
        cells = self._seqs.get(seq, [])
        self._release(cells[p0:p1])
        del cells[p0:p1]

    def shared_from(self, seq: int, pos: int) -> bool:
        """True when a cell of ``seq`` at a position >= pos also belongs to another sequence."""
        return any(self._refs[c] > 1 for c in self._seqs.get(seq, [])[pos:])

    def private_from(self, seq: int) -> int:
        """The first position from which every cell of ``seq`` is its alone (its length
        when the last cell is shared)."""
        cells = self._seqs.get(seq, [])
        p = len(cells)
        while p > 0 and self._refs[cells[p - 1]] == 1:
            p -= 1
        return p

    def freed_by_clearing(self, seqs: Iterable[int]) -> int:
        """Cells that would be freed if every sequence in ``seqs`` were cleared: those no
        other sequence holds."""
        held: Counter[int] = Counter()
        for seq in set(seqs):
            held.update(self._seqs.get(seq, ()))
        return sum(1 for cell, n in held.items() if n == self._refs[cell])

    def sharers(self, seq: int) -> int:
        """Cells of ``seq`` that some other sequence holds too."""
        return sum(1 for c in self._seqs.get(seq, ()) if self._refs[c] > 1)

    def count_in(self, seq: int, cells: set[int]) -> int:
        """How many cells of ``seq`` are in ``cells``."""
        return sum(1 for c in self._seqs.get(seq, ()) if c in cells)

    def common_cells(self, a: int, b: int) -> int:
        """How many leading positions ``a`` and ``b`` hold in the very same cells."""
        ca, cb = self._seqs.get(a, []), self._seqs.get(b, [])
        n = min(len(ca), len(cb))
        i = 0
        while i < n and ca[i] == cb[i]:
            i += 1
        return i

    def _release(self, cells: Iterable[int]) -> None:
        for c in cells:
            self._refs[c] -= 1
            if self._refs[c] <= 0:
                del self._refs[c]

    def owners(self, order: Iterable[tuple[object, int, int]]) -> dict[object, int]:
        """Attribute every used cell to its first claimant.

        ``order`` lists (owner, seq, from_pos): the owner claims the not-yet-claimed cells of
        ``seq`` at positions >= from_pos, then at positions < from_pos. Pools come first,
        parents before children, then sessions; the counts add up to ``used``.
        """
        claimed: set[int] = set()
        counts: dict[object, int] = {}
        for owner, seq, from_pos in order:
            cells = self._seqs.get(seq, [])
            n = 0
            for c in itertools.chain(cells[from_pos:], cells[:from_pos]):
                if c not in claimed:
                    claimed.add(c)
                    n += 1
            counts[owner] = counts.get(owner, 0) + n
        return counts
