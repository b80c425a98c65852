"""KV memory operations, applied to llama.cpp and to the shadow model together.

Every change to a sequence's cells goes through here, so ``KVModel`` (ownership accounting)
can never drift from what llama.cpp holds. Engine thread only.

Guards (sliding-window models): llama.cpp hands out a cell that one sequence alone holds
once it has left that sequence's window. A pool's sequence has a guard sequence that holds
exactly the same cells (its build tokens are decoded into both, ``guard_of``; every copy and
removal here is applied to both), so no pool cell is ever held by one sequence alone. The
shadow model does not list guards: a guard's cells are its pool's.
"""

from __future__ import annotations

from collections.abc import Mapping

from polykv_engine.kv.cells import KVModel
from polykv_engine.llama.runtime import LlamaRuntime


class KVCache:
    def __init__(self, rt: LlamaRuntime, guards: Mapping[int, int] | None = None) -> None:
        self.rt = rt
        self.model = KVModel()
        self._guards = dict(guards or {})  # guarded sequence -> its guard
        # Bumped by every change that can move a cell between owners (not by appends), so
        # derived figures such as reclaimable cells are recomputed only when needed.
        self.version = 0

    def length(self, seq: int) -> int:
        return self.model.length(seq)

    def guard_of(self, seq: int) -> int | None:
        """The sequence that holds ``seq``'s cells too (decode its tokens into both)."""
        return self._guards.get(seq)

    def _rm(self, seq: int, p0: int, p1: int) -> None:
        self.rt.seq_rm(seq, p0, p1)
        guard = self._guards.get(seq)
        if guard is not None:
            self.rt.seq_rm(guard, p0, p1)

    def decoded(self, seq: int, n: int) -> None:
        """``n`` tokens were just decoded at the end of ``seq``."""
        self.model.append(seq, n)

    def truncate(self, seq: int, pos: int) -> None:
        """Keep positions [0, pos) of ``seq``."""
        self.version += 1
        if self.model.length(seq) > pos:
            self._rm(seq, pos, -1)
            self.model.truncate(seq, pos)

    def clear(self, seq: int) -> None:
        self.version += 1
        self._rm(seq, -1, -1)
        self.model.clear(seq)

    def share(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``dst`` (ending at p0) gains ``src``'s cells [p0, p1): no data is copied."""
        self.version += 1
        if p1 <= p0:
            return
        self.rt.seq_cp(src, dst, p0, p1)
        guard = self._guards.get(dst)
        if guard is not None:
            self.rt.seq_cp(src, guard, p0, p1)
        self.model.copy(src, dst, p0, p1)

    def rebase(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``dst`` computed positions [p0, p1) itself, for the same tokens ``src`` holds
        there: drop its own cells and take ``src``'s (its later positions stay put)."""
        self.version += 1
        if p1 <= p0:
            return
        self.rt.seq_rm(dst, p0, p1)
        self.rt.seq_cp(src, dst, p0, p1)
        self.model.replace(src, dst, p0, p1)

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        """Context shift: drop [n_keep, n_keep + n_discard) and move the rest down."""
        self.version += 1
        n_past = self.model.length(seq)
        self.rt.seq_rm(seq, n_keep, n_keep + n_discard)
        self.rt.seq_add(seq, n_keep + n_discard, n_past, -n_discard)
        self.model.remove_range(seq, n_keep, n_keep + n_discard)

    def save_span(self, seq: int, scratch: int, p0: int, p1: int = -1) -> bytearray:
        """llama.cpp's serialized cells of ``seq`` at positions [p0, p1) (-1: to the end),
        nothing else: they are shared into the empty ``scratch`` and saved from there. On a
        recurrent model the state at the end of ``seq`` comes along."""
        self.rt.seq_cp(seq, scratch, p0, p1)
        try:
            return self.rt.seq_save(scratch)
        finally:
            self.rt.seq_rm(scratch)

    def load_span(
        self, seq: int, scratch: int, p0: int, p1: int, data: bytes | bytearray | memoryview
    ) -> bool:
        """Put saved cells back at positions [p0, p1) of ``seq``, which must end at p0.
        False, with nothing changed, when llama.cpp finds no room for them, refuses the
        bytes, or they hold other positions than [p0, p1)."""
        if self.model.length(seq) != p0:
            raise ValueError(f"seq {seq} has {self.model.length(seq)} positions, not {p0}")
        if not self.rt.seq_load(scratch, data):
            self.rt.seq_rm(scratch)
            return False
        try:
            if not self._holds(scratch, p0, p1):
                return False
            self.version += 1
            self.rt.seq_cp(scratch, seq, p0, -1)
            guard = self._guards.get(seq)
            if guard is not None:
                self.rt.seq_cp(scratch, guard, p0, -1)
        finally:
            self.rt.seq_rm(scratch)
        self.model.append(seq, p1 - p0)
        return True

    def _holds(self, seq: int, p0: int, p1: int) -> bool:
        """Whether ``seq`` holds exactly positions [p0, p1): its last, and (where cells are
        kept by position) its first. On a sliding-window model the first is the window
        layers': cells llama.cpp's writer left out of the window show here."""
        info = self.rt.info
        if self.rt.seq_pos_max(seq) != p1 - 1:
            return False
        return info.is_recurrent or info.is_hybrid or self.rt.seq_pos_min(seq) == p0

    def park(self, seq: int, scratch: int, p0: int) -> bytearray:
        """Move positions [p0, end) of ``seq``, cells only it holds (``model.private_from``),
        out of the cache: their serialized data. ``scratch`` is an empty sequence id, used to
        save just that tail."""
        data = self.save_span(seq, scratch, p0)
        self.truncate(seq, p0)
        return data

    def unpark(self, seq: int, scratch: int, p0: int, n: int, data: bytes | bytearray) -> bool:
        """Put back ``n`` parked cells at positions [p0, p0 + n) of ``seq``, which must end
        at p0. False (nothing changed) when the cache has no room for them."""
        return self.load_span(seq, scratch, p0, p0 + n, data)

    @property
    def used(self) -> int:
        return self.model.used
