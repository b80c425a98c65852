"""Prefix reuse: which of a prompt's tokens a slot takes from cells already in the cache,
and from which sequence (vLLM's ``get_computed_blocks``, SGLang's ``match_prefix``).

Pure: the engine describes the slot's cache, the pool the request attached and the other
resident sequences as plain views; ``plan`` answers with a ``PrefixPlan`` that
``SlotTable.apply_prefix`` carries out on llama.cpp's cells and the slot's tokens together.
Every rule of reuse is stated once, here:

- the last prompt token is always computed again: its logits sample the first new token
  (``reusable``);
- an attach shares the pool's first P tokens: P as the request declared it (checked against
  the pool), else the longest common prefix of prompt and pool (auto-P);
- the slot keeps its own cache up to its common prefix with the prompt; a request that asks
  for no cache reuse keeps only the pool's part;
- on a sliding-window model, cached tokens count only while the window before them is still
  in the cache (llama.cpp recycles a cell one sequence alone holds once it left that
  sequence's window; what is left of a sequence there is one run of positions, from its
  ``pos_min`` on, so this is read exactly): a slot's own, or another sequence's for
  automatic sharing (cells two sequences hold are never recycled: a guarded pool's, and
  those a session shares);
- on a recurrent or hybrid model (``exact_length``), a sequence's state exists only after its
  last token: a pool is attached at exactly its length or the request is refused
  (``recurrent_attach``), and a slot's cache is reused whole or not at all (a cache holding
  the pool's tokens and more is kept as it is, never swapped for the pool's cells: that
  would replace its state with the pool's);
- automatic sharing then takes the longest prefix another resident sequence holds: a slot of
  the same tenant, or the attached pool (never a pool the request did not name);
- a prompt waits for a prefix another slot is prefilling when that would save at least
  ``SHARE_WAIT_MIN_TOKENS`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polykv_engine.kv.memory import window_joins, window_kept
from polykv_engine.pools.tree import PoolError
from polykv_engine.tokens import common_prefix_len

# A prompt waits for another slot's prefill only when it would then share at least this
# many more tokens: below it, computing them in parallel costs less than waiting.
SHARE_WAIT_MIN_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Resident:
    """A sequence whose cells hold ``tokens`` from position 0 (on a sliding-window model,
    its window layers' cells from ``cells_from`` on: llama.cpp recycled those below)."""

    seq_id: int
    tokens: Sequence[int]
    cells_from: int = 0


@dataclass(frozen=True, slots=True)
class AttachedPool:
    """The resident pool a request attaches to."""

    seq_id: int
    tokens: Sequence[int]
    label: str
    declared_p: int | None = None  # the request's shared_prefix_n_tokens; None: auto-P


@dataclass(frozen=True, slots=True)
class PrefixPlan:
    """What a slot reuses of a prompt, in the order ``SlotTable.apply_prefix`` applies it:
    first the pool's cells ``[0, pool_p)``, then the slot's cache cut to ``[0, keep)``, then
    ``[keep, reuse)`` shared from ``share_seq``'s cells. The prompt is computed from
    ``reuse`` on."""

    pool_seq: int = -1  # the attached pool's sequence (-1: none)
    pool_p: int = 0  # P: the slot's sequence starts with the pool's cells [0, P)
    pool_fresh: bool = False  # the slot's cache goes and the pool's cells are shared in;
    # else the slot's own cells for those tokens are swapped for the pool's (same tokens)
    # > 0: the cut the slot's cache could not be kept at (the sliding window before it was
    # recycled, or a recurrent state cannot go back to it): the whole cache goes instead.
    dropped_at: int = 0
    keep: int = 0  # tokens of the slot's cache kept
    share_seq: int = -1  # the sequence [keep, reuse) is shared from (-1: none)
    reuse: int = 0  # prompt tokens not computed again

    @property
    def auto_shared(self) -> int:
        """Tokens taken from another sequence by automatic sharing."""
        return self.reuse - self.keep


def reusable(prompt: Sequence[int], n: int) -> int:
    """At most ``n`` tokens of ``prompt`` are reused: the last one is computed again, for the
    logits that sample the first new token."""
    return min(n, len(prompt) - 1)


def pool_prefix(prompt: Sequence[int], pool: AttachedPool, exact_length: bool = False) -> int:
    """P, the pool tokens an attach shares: as declared, else the common prefix (auto-P).
    A declared P beyond the pool or over tokens the prompt does not match is refused, and
    with ``exact_length`` any P short of the pool's length."""
    p = pool.declared_p
    if p is None:
        p = reusable(prompt, common_prefix_len(prompt, pool.tokens))
        if exact_length and p < len(pool.tokens):
            raise PoolError(
                409,
                "recurrent_attach",
                f"this model keeps a recurrent state, which pool {pool.label!r} has only at "
                f"its end (token {len(pool.tokens)}): the prompt must start with the pool's "
                f"whole prefix and go on past it, but it shares only {p} of its tokens",
            )
        return p
    if p > len(pool.tokens):
        raise PoolError(
            409,
            "prefix_mismatch",
            f"shared_prefix_n_tokens {p} exceeds pool {pool.label!r}'s prefix_len "
            f"{len(pool.tokens)}",
        )
    d = common_prefix_len(prompt[:p], pool.tokens[:p])
    if d < p:
        raise PoolError(
            409,
            "prefix_mismatch",
            f"the prompt differs from pool {pool.label!r} at token {d}, inside the declared "
            f"shared prefix of {p} tokens",
        )
    if exact_length and reusable(prompt, p) < len(pool.tokens):
        raise PoolError(
            409,
            "recurrent_attach",
            f"this model keeps a recurrent state, which pool {pool.label!r} has only at its "
            f"end: shared_prefix_n_tokens must be its length {len(pool.tokens)}, with the "
            f"prompt going on past it (got {p} of a {len(prompt)}-token prompt)",
        )
    return reusable(prompt, p)


def resident_prefix(prompt: Sequence[int], residents: Sequence[Resident]) -> tuple[int, int]:
    """(sequence id, length) of the resident holding the longest prefix of ``prompt``;
    (-1, 0) when none holds any. The first of equals wins."""
    best_seq, best = -1, 0
    for r in residents:
        if len(r.tokens) > best:
            p = common_prefix_len(r.tokens, prompt)
            if p > best:
                best_seq, best = r.seq_id, p
    return best_seq, best


def plan(
    prompt: Sequence[int],
    cache: Sequence[int],
    *,
    reuse_cache: bool,
    pool: AttachedPool | None = None,
    residents: Sequence[Resident] = (),
    exact_length: bool = False,
    n_swa: int = 0,
    cache_from: int = 0,
) -> PrefixPlan:
    """How a slot whose cells hold ``cache`` serves ``prompt``. ``reuse_cache``: the request
    allows reuse of cached tokens (``cache_prompt``); ``residents``: the other sequences
    automatic sharing may take from (empty: no automatic sharing); ``exact_length``: the
    model's memory is exact only at a sequence's end (recurrent, hybrid). Sliding-window
    models (``n_swa`` > 0): the slot's window layers hold its positions from ``cache_from``
    on. Raises ``PoolError`` for a declared P the pool does not match, or an attach below
    the pool's length where ``exact_length``."""

    def own_usable(n: int) -> bool:
        """The slot's cache can be kept up to ``n`` prompt tokens: a recurrent state only
        whole, a sliding window only while the window before ``n`` is still there."""
        if exact_length and n < len(cache):
            return False
        return window_kept(cache_from, n, n_swa)

    pool_seq, pool_p, fresh = -1, 0, False
    if pool is not None:
        pool_seq, pool_p = pool.seq_id, pool_prefix(prompt, pool, exact_length)
        own = common_prefix_len(cache, prompt) if reuse_cache else 0
        if not own_usable(reusable(prompt, own)):
            own = 0  # a cache cut short, or missing its window, is no cache at all
        fresh = pool_p > own
        if fresh:
            cache, cache_from = prompt[:pool_p], 0  # the pool's cells: guarded, whole
        elif exact_length or cache_from > pool_p:
            # Its own cache goes on from past the pool: kept whole. (A window that lost
            # positions past the pool's would keep a gap after the pool's cells.)
            pool_seq, pool_p = -1, 0
    keep = common_prefix_len(cache, prompt)
    if not reuse_cache:
        keep = min(keep, pool_p)
    keep = reusable(prompt, keep)
    dropped_at = 0
    if keep > 0 and not own_usable(keep):
        dropped_at, keep = keep, 0
    share_seq, reuse = -1, keep
    if reuse_cache:
        for r in residents:  # the longest usable prefix; the first of equals
            if len(r.tokens) <= reuse:
                continue
            p = reusable(prompt, common_prefix_len(r.tokens, prompt))
            if p > reuse and window_joins(r.cells_from, keep, p, n_swa):
                share_seq, reuse = r.seq_id, p
    return PrefixPlan(pool_seq, pool_p, fresh, dropped_at, keep, share_seq, reuse)


def waits_for_shared_prefix(
    prompt: Sequence[int],
    prefilling: Sequence[Sequence[int]],
    residents: Sequence[Resident],
    own: Sequence[int] = (),
    pool: Sequence[int] | None = None,
) -> bool:
    """Whether a prompt should wait for a prefix another slot is prefilling now (the
    agents released together on one system prompt), then share those cells instead of
    computing them a second time in parallel. ``prefilling``: the prompts being prefilled;
    ``own``: the session's cached tokens; ``pool``: the attached pool's tokens."""
    if not prefilling:
        return False
    coming = max(common_prefix_len(p, prompt) for p in prefilling)
    if coming < SHARE_WAIT_MIN_TOKENS:
        return False
    have = common_prefix_len(own, prompt)
    if pool is not None:
        have = max(have, common_prefix_len(pool, prompt))
    _, resident = resident_prefix(prompt, residents)
    return coming - max(have, resident) >= SHARE_WAIT_MIN_TOKENS
