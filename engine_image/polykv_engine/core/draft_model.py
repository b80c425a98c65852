"""Speculative drafts from a second, smaller model of the same vocabulary (engine thread only).

The draft model has a context of its own, one sequence per slot, kept as a copy of each
speculating session's tokens: before drafting, a sequence is cut back to what it shares
with the session's context (guesses the target rejected go) and fed the rest; then every
session's draft grows one greedy token per draft decode, the sessions batched together.
The draft model's cells never mix with the target's: pools and prompt caches are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polykv_engine.llama.runtime import Batch, LlamaError, LlamaRuntime
from polykv_engine.tokens import common_prefix_len


@dataclass(frozen=True, slots=True)
class DraftRequest:
    seq: int  # the slot id: the draft model's sequence for that session
    context: Sequence[int]  # the session's tokens, the one to be decoded next included
    n: int  # at most this many draft tokens


class DraftModel:
    def __init__(self, rt: LlamaRuntime, target_vocab: int) -> None:
        if rt.info.n_vocab != target_vocab:
            raise LlamaError(
                f"the draft model's vocabulary has {rt.info.n_vocab} tokens, the model's "
                f"{target_vocab}: a draft model must share the model's vocabulary"
            )
        self.rt = rt
        self._batch: Batch = rt.new_batch()
        self._held: dict[int, list[int]] = {}  # what each sequence holds in the draft's KV

    def forget(self, seq: int) -> None:
        self.rt.seq_rm(seq)
        self._held.pop(seq, None)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        """Greedy drafts, by sequence (empty where the draft model's cache has no room)."""
        drafts: dict[int, list[int]] = {r.seq: [] for r in requests}
        live = [r for r in requests if r.n > 0 and r.context]
        idx = self._catch_up(live)
        while idx:
            for r in live:
                if r.seq in idx:
                    drafts[r.seq].append(int(self.rt.logits(idx[r.seq]).argmax()))
            going = [
                r
                for r in live
                if r.seq in idx
                and len(drafts[r.seq]) < r.n
                and len(self._held[r.seq]) + 1 < self.rt.n_ctx_seq
            ]
            if not going:
                break
            batch = self._batch
            batch.clear()
            idx = {
                r.seq: batch.add(drafts[r.seq][-1], len(self._held[r.seq]), r.seq, True)
                for r in going
            }
            if not self._decode(going):
                break
            for r in going:
                self._held[r.seq].append(drafts[r.seq][-1])
        return drafts

    def _catch_up(self, requests: Sequence[DraftRequest]) -> dict[int, int]:
        """Bring each sequence to its session's context: all but the last token in as many
        batches as they take, then every last token in one batch, whose logits predict the
        first draft tokens. Returns their batch indices by sequence (empty: no room)."""
        rt, batch = self.rt, self._batch
        ready = []
        for r in requests:
            held = self._held.setdefault(r.seq, [])
            keep = min(common_prefix_len(held, r.context), len(r.context) - 1)
            if keep < len(held):
                rt.seq_rm(r.seq, keep, -1)
                del held[keep:]
            if len(r.context) < rt.n_ctx_seq:
                ready.append(r)
        todo = [(r, len(self._held[r.seq])) for r in ready]
        while todo:
            batch.clear()
            later = []
            for r, start in todo:
                n = min(len(r.context) - 1 - start, batch.capacity - batch.n)
                if n > 0:
                    batch.add_span(r.context[start : start + n], start, r.seq, False)
                if start + n < len(r.context) - 1:
                    later.append((r, start + n))
            if batch.n and not self._decode([r for r, _ in todo]):
                return {}
            for r, start in todo:
                end = next((s for q, s in later if q is r), len(r.context) - 1)
                self._held[r.seq].extend(r.context[start:end])
            todo = later
        batch.clear()
        idx = {r.seq: batch.add(r.context[-1], len(r.context) - 1, r.seq, True) for r in ready}
        if not idx or not self._decode(ready):
            return {}
        for r in ready:
            self._held[r.seq].append(r.context[-1])
        return idx

    def _decode(self, requests: Sequence[DraftRequest]) -> bool:
        """Decode the batch; where the draft's cache is full, its sequences start over."""
        if self.rt.decode(self._batch) == 0:
            return True
        for r in requests:
            self.forget(r.seq)
        return False
