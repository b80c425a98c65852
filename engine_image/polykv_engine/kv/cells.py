"""A shadow of the unified KV cache's cell membership (pure).

llama.cpp exposes no per-cell view, yet PolyKV must attribute every KV byte to exactly one
owner (a pool's own range or a session's private suffix). This model mirrors each memory
operation the engine performs: a sequence is a list of cell ids by position; ``copy`` makes
the destination share the source's cells (what ``llama_memory_seq_cp`` does in a unified
cache); a cell is freed when no sequence holds it any more. Tests compare ``used`` with
llama.cpp's own count of used cells, so the model is checked against reality.

Each cell knows which sequences hold it, so one sequence's share of the cache is found from
its own cells alone: what a pool's status costs does not grow with the number of pools.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable


class KVModel:
    def __init__(self) -> None:
        self._seqs: dict[int, list[int]] = {}
        self._holders: dict[int, set[int]] = {}  # cell -> the sequences holding it
        self._ids = itertools.count()

    def cells(self, seq: int) -> list[int]:
        """Cell ids of ``seq`` by position (a copy)."""
        return list(self._seqs.get(seq, ()))

    def length(self, seq: int) -> int:
        return len(self._seqs.get(seq, ()))

    @property
    def used(self) -> int:
        return len(self._holders)

    def append(self, seq: int, n: int) -> None:
        """``n`` freshly computed tokens were decoded at the end of ``seq``."""
        new = [next(self._ids) for _ in range(n)]
        self._seqs.setdefault(seq, []).extend(new)
        for c in new:
            self._holders[c] = {seq}

    def copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``dst`` (which must end at ``p0``) gains ``src``'s cells for positions [p0, p1)."""
        dst_cells = self._seqs.setdefault(dst, [])
        if len(dst_cells) != p0:
            raise ValueError(f"seq {dst} has {len(dst_cells)} positions; copy must start there")
        shared = self._seqs.get(src, [])[p0:p1]
        if len(shared) != p1 - p0:
            raise ValueError(f"seq {src} does not hold positions [{p0}, {p1})")
        dst_cells.extend(shared)
        self._hold(dst, shared)

    def replace(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``dst``'s positions [p0, p1) now hold ``src``'s cells there instead of its own."""
        dst_cells, src_cells = self._seqs.get(dst, []), self._seqs.get(src, [])
        if len(dst_cells) < p1 or len(src_cells) < p1:
            raise ValueError(f"seqs {src} and {dst} must both hold positions [{p0}, {p1})")
        self._release(dst, dst_cells[p0:p1])
        dst_cells[p0:p1] = src_cells[p0:p1]
        self._hold(dst, src_cells[p0:p1])

    def truncate(self, seq: int, pos: int) -> None:
        """Drop positions >= ``pos`` of ``seq``."""
        cells = self._seqs.get(seq)
        if not cells:
            return
        self._release(seq, cells[pos:])
        del cells[pos:]

    def clear(self, seq: int) -> None:
        self.truncate(seq, 0)
        self._seqs.pop(seq, None)

    def remove_range(self, seq: int, p0: int, p1: int) -> None:
        """Drop [p0, p1) and shift later positions down (a context shift)."""
        cells = self._seqs.get(seq, [])
        self._release(seq, cells[p0:p1])
        del cells[p0:p1]

    def shared_from(self, seq: int, pos: int) -> bool:
        """True when a cell of ``seq`` at a position >= pos also belongs to another sequence."""
        return any(len(self._holders[c]) > 1 for c in self._seqs.get(seq, [])[pos:])

    def private_from(self, seq: int) -> int:
        """The first position from which every cell of ``seq`` is its alone (its length
        when the last cell is shared)."""
        cells = self._seqs.get(seq, [])
        p = len(cells)
        while p > 0 and len(self._holders[cells[p - 1]]) == 1:
            p -= 1
        return p

    def freed_by_clearing(self, seqs: Iterable[int]) -> int:
        """Cells that would be freed if every sequence in ``seqs`` were cleared: those no
        other sequence holds."""
        held: Counter[int] = Counter()
        for seq in set(seqs):
            held.update(self._seqs.get(seq, ()))
        return sum(1 for cell, n in held.items() if n == len(self._holders[cell]))

    def sharers(self, seq: int) -> int:
        """Cells of ``seq`` that some other sequence holds too."""
        return sum(1 for c in self._seqs.get(seq, ()) if len(self._holders[c]) > 1)

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

    def owned(self, seq: int, rank: Callable[[int], tuple[int, int]]) -> int:
        """Cells of ``seq`` that are its to account for: those where it has the lowest
        ``rank`` of every sequence holding the cell. Costs the length of ``seq``, not the
        size of the cache (a run of cells held by the same sequences is ranked once)."""
        n, last, mine = 0, None, False
        for c in self._seqs.get(seq, ()):
            holders = self._holders[c]
            if len(holders) == 1:
                n += 1
                continue
            if holders != last:
                last, mine = holders, min(holders, key=rank) == seq
            n += mine
        return n

    def owners(self, rank: Callable[[int], tuple[int, int]]) -> Counter[int]:
        """``owned`` for every sequence at once, in one pass over the used cells. With a
        rank that orders the sequences uniquely the counts add up to ``used``."""
        counts: Counter[int] = Counter()
        for holders in self._holders.values():
            counts[next(iter(holders)) if len(holders) == 1 else min(holders, key=rank)] += 1
        return counts

    def _hold(self, seq: int, cells: Iterable[int]) -> None:
        for c in cells:
            self._holders[c].add(seq)

    def _release(self, seq: int, cells: Iterable[int]) -> None:
        for c in cells:
            holders = self._holders[c]
            holders.discard(seq)
            if not holders:
                del self._holders[c]
