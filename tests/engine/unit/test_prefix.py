"""Prefix reuse decided without a model: what a slot keeps, attaches and shares."""

from __future__ import annotations

import pytest

from polykv_engine.core.prefix import (
    SHARE_WAIT_MIN_TOKENS,
    AttachedPool,
    PrefixPlan,
    Resident,
    plan,
    resident_prefix,
    reusable,
    waits_for_shared_prefix,
)
from polykv_engine.pools.tree import PoolError

PROMPT = list(range(100, 110))  # ten tokens


def pool(tokens: list[int], declared: int | None = None, seq: int = 9) -> AttachedPool:
    return AttachedPool(seq, tokens, "p", declared)


def test_the_last_prompt_token_is_always_computed_again() -> None:
    assert reusable(PROMPT, 10) == 9
    assert reusable(PROMPT, 4) == 4
    assert plan(PROMPT, PROMPT, reuse_cache=True) == PrefixPlan(keep=9, reuse=9)
    whole = pool(PROMPT)
    assert plan(PROMPT, [], reuse_cache=True, pool=whole).pool_p == 9
    shared = plan(PROMPT, [], reuse_cache=True, residents=[Resident(3, PROMPT)])
    assert (shared.share_seq, shared.keep, shared.reuse) == (3, 0, 9)


def test_the_slot_keeps_its_common_prefix_and_cuts_the_rest() -> None:
    cache = [*PROMPT[:4], 1, 2, 3]
    assert plan(PROMPT, cache, reuse_cache=True) == PrefixPlan(keep=4, reuse=4)
    assert plan(PROMPT, cache, reuse_cache=False) == PrefixPlan(keep=0, reuse=0)


def test_attach_shares_the_common_prefix_with_the_pool_auto_p() -> None:
    got = plan(PROMPT, [7, 7], reuse_cache=True, pool=pool([*PROMPT[:6], 55, 56]))
    assert got == PrefixPlan(pool_seq=9, pool_p=6, pool_fresh=True, keep=6, reuse=6)


def test_attach_swaps_a_cache_that_already_holds_the_pool_tokens() -> None:
    # The session ran before the pool existed: its own cells hold the pool's tokens and
    # more, so nothing is dropped; those cells are exchanged for the pool's.
    got = plan(PROMPT, PROMPT[:8], reuse_cache=True, pool=pool(PROMPT[:5]))
    assert got == PrefixPlan(pool_seq=9, pool_p=5, pool_fresh=False, keep=8, reuse=8)


def test_without_cache_reuse_only_the_pool_part_is_reused() -> None:
    got = plan(PROMPT, PROMPT[:8], reuse_cache=False, pool=pool(PROMPT[:5]))
    assert (got.pool_fresh, got.pool_p, got.keep, got.reuse) == (True, 5, 5, 5)
    residents = [Resident(3, PROMPT)]
    assert plan(PROMPT, [], reuse_cache=False, residents=residents).share_seq == -1


def test_a_declared_prefix_is_checked_against_the_pool() -> None:
    got = plan(PROMPT, [], reuse_cache=True, pool=pool(PROMPT[:6], declared=4))
    assert got.pool_p == 4
    with pytest.raises(PoolError) as beyond:
        plan(PROMPT, [], reuse_cache=True, pool=pool(PROMPT[:6], declared=7))
    assert beyond.value.reason == "prefix_mismatch"
    assert "exceeds" in beyond.value.message
    other = [*PROMPT[:2], 0, *PROMPT[3:6]]
    with pytest.raises(PoolError) as differs:
        plan(PROMPT, [], reuse_cache=True, pool=pool(other, declared=5))
    assert differs.value.reason == "prefix_mismatch"
    assert "at token 2" in differs.value.message


def test_a_declared_prefix_still_leaves_the_last_token_to_compute() -> None:
    short = PROMPT[:4]
    assert plan(short, [], reuse_cache=True, pool=pool(PROMPT, declared=4)).pool_p == 3


def test_a_recycled_sliding_window_drops_the_cache() -> None:
    cache = [*PROMPT[:8], 0, 0]
    # 8 tokens kept, a window of 4: the token at 8 sees positions 5..7, which must be there.
    whole = plan(PROMPT, cache, reuse_cache=True, n_swa=4, cache_from=5)
    assert whole == PrefixPlan(keep=8, reuse=8)
    recycled = plan(PROMPT, cache, reuse_cache=True, n_swa=4, cache_from=6)
    assert recycled == PrefixPlan(dropped_at=8, keep=0, reuse=0)
    assert not plan(PROMPT, cache, reuse_cache=True, cache_from=100).dropped_at  # no window
    # A continuation's window is its newest positions, which llama.cpp never hands out.
    assert not plan(PROMPT, PROMPT[:8], reuse_cache=True, n_swa=4, cache_from=5).dropped_at


def test_a_fresh_attach_on_a_sliding_window_takes_the_guarded_pool_cells() -> None:
    got = plan(PROMPT, [1, 2, 3], reuse_cache=True, pool=pool(PROMPT[:6]), n_swa=2, cache_from=2)
    assert got == PrefixPlan(pool_seq=9, pool_p=6, pool_fresh=True, keep=6, reuse=6)
    # A cache holding the pool's tokens whose window was recycled gives way to the pool.
    got = plan(PROMPT, PROMPT[:8], reuse_cache=True, pool=pool(PROMPT[:6]), n_swa=2, cache_from=8)
    assert got == PrefixPlan(pool_seq=9, pool_p=6, pool_fresh=True, keep=6, reuse=6)
    # One that lost positions past the pool's keeps its own cells, unlinked: swapping the
    # pool's in would leave a gap between them and what is left.
    got = plan(PROMPT, PROMPT[:9], reuse_cache=True, pool=pool(PROMPT[:4]), n_swa=2, cache_from=6)
    assert got == PrefixPlan(keep=9, reuse=9)


def test_automatic_sharing_on_a_sliding_window_takes_only_whole_runs() -> None:
    residents = [Resident(1, PROMPT, cells_from=3)]  # positions 0..2 recycled
    # An empty slot needs the window before the reuse point, [5, 9) with a window of 5.
    got = plan(PROMPT, [], reuse_cache=True, residents=residents, n_swa=5)
    assert (got.share_seq, got.keep, got.reuse) == (1, 0, 9)
    assert plan(PROMPT, [], reuse_cache=True, residents=residents, n_swa=8).share_seq == -1
    # A slot that keeps [0, 2) itself would have a gap at 2: the resident lost it.
    assert plan(PROMPT, PROMPT[:2], reuse_cache=True, residents=residents, n_swa=2).reuse == 2
    assert plan(PROMPT, PROMPT[:3], reuse_cache=True, residents=residents, n_swa=2).reuse == 9
    # Of two, the one whose cells can be taken, though the other holds more.
    both = [Resident(1, PROMPT, cells_from=9), Resident(2, PROMPT[:7])]
    got = plan(PROMPT, [], reuse_cache=True, residents=both, n_swa=4)
    assert (got.share_seq, got.reuse) == (2, 7)


def test_a_recurrent_model_attaches_at_exactly_the_pool_length() -> None:
    exact = plan(PROMPT, [], reuse_cache=True, pool=pool(PROMPT[:6]), exact_length=True)
    assert (exact.pool_p, exact.keep) == (6, 6)
    declared = pool(PROMPT[:6], declared=6)
    assert plan(PROMPT, [], reuse_cache=True, pool=declared, exact_length=True).pool_p == 6
    refused = [
        pool([*PROMPT[:4], 0, 0]),  # auto-P short of L: the prompt leaves the pool at 4
        pool(PROMPT),  # the prompt is the pool's prefix: its last token would be cut off
        pool(PROMPT[:6], declared=4),  # a declared P below L
    ]
    for p in refused:
        with pytest.raises(PoolError) as e:
            plan(PROMPT, [], reuse_cache=True, pool=p, exact_length=True)
        assert (e.value.status, e.value.reason) == (409, "recurrent_attach")


def test_a_recurrent_cache_is_reused_whole_or_not_at_all() -> None:
    # A continuation keeps it; a prompt that leaves it (or repeats it: the last token would
    # be cut off) starts over.
    assert plan(PROMPT, PROMPT[:7], reuse_cache=True, exact_length=True).keep == 7
    diverged = plan(PROMPT, [*PROMPT[:5], 0, 0], reuse_cache=True, exact_length=True)
    assert (diverged.dropped_at, diverged.keep) == (5, 0)
    assert plan(PROMPT, PROMPT, reuse_cache=True, exact_length=True).keep == 0
    # A cache that holds the pool's tokens and goes on is kept as it is (never swapped
    # for the pool's cells); one that diverged is replaced by the pool's.
    kept = plan(PROMPT, PROMPT[:8], reuse_cache=True, pool=pool(PROMPT[:5]), exact_length=True)
    assert kept == PrefixPlan(keep=8, reuse=8)
    cache = [*PROMPT[:7], 0]
    swapped = plan(PROMPT, cache, reuse_cache=True, pool=pool(PROMPT[:5]), exact_length=True)
    assert (swapped.pool_fresh, swapped.pool_p, swapped.keep) == (True, 5, 5)


def test_automatic_sharing_takes_the_longest_resident_prefix_beyond_the_cache() -> None:
    residents = [Resident(1, PROMPT[:3]), Resident(2, PROMPT[:7]), Resident(3, PROMPT[:7])]
    assert resident_prefix(PROMPT, residents) == (2, 7)  # the first of equals
    assert resident_prefix(PROMPT, [Resident(1, [5, 5])]) == (-1, 0)
    got = plan(PROMPT, PROMPT[:2], reuse_cache=True, residents=residents)
    assert got == PrefixPlan(keep=2, share_seq=2, reuse=7)
    assert got.auto_shared == 5
    # Nothing to gain: the slot's own cache is as long.
    assert plan(PROMPT, PROMPT[:7], reuse_cache=True, residents=residents).share_seq == -1


def test_sharing_extends_an_attached_pool() -> None:
    residents = [Resident(1, PROMPT[:8]), Resident(9, PROMPT[:4])]
    got = plan(PROMPT, [], reuse_cache=True, pool=pool(PROMPT[:4]), residents=residents)
    assert (got.pool_p, got.keep, got.share_seq, got.reuse) == (4, 4, 1, 8)


def long_prompt(n: int, tail: int = 0, base: int = 10_000) -> list[int]:
    """``n`` tokens every such prompt has, then ``tail`` of its own (from ``base``)."""
    return [*range(n), *range(base, base + tail)]


def test_a_prompt_waits_for_a_long_prefix_being_prefilled() -> None:
    n = SHARE_WAIT_MIN_TOKENS
    prompt = long_prompt(2 * n, 5)
    coming = [long_prompt(2 * n, 9, base=20_000)]
    assert waits_for_shared_prefix(prompt, coming, [])
    assert not waits_for_shared_prefix(prompt, [], [])
    # Too short to be worth the wait.
    assert not waits_for_shared_prefix(
        long_prompt(n - 1, 5), [long_prompt(n - 1, 9, base=20_000)], []
    )


def test_no_wait_for_what_the_request_already_reuses() -> None:
    n = SHARE_WAIT_MIN_TOKENS
    prompt = long_prompt(2 * n, 5)
    coming = [long_prompt(2 * n, 9, base=20_000)]
    almost = long_prompt(2 * n - n // 2)  # saves fewer than n more tokens than this
    assert not waits_for_shared_prefix(prompt, coming, [], own=almost)
    assert not waits_for_shared_prefix(prompt, coming, [], pool=almost)
    assert not waits_for_shared_prefix(prompt, coming, [Resident(4, almost)])
    assert waits_for_shared_prefix(prompt, coming, [], own=long_prompt(n - 1))
