"""Prompt-lookup drafts and the draft length's response to acceptance (policy.speculation)."""

from __future__ import annotations

from polykv_engine.policy.speculation import (
    DRAFT_START,
    MAX_COOLDOWN,
    NgramIndex,
    Speculation,
)


def index(tokens: list[int]) -> NgramIndex:
    idx = NgramIndex()
    idx.extend(tokens)
    return idx


def test_the_tokens_after_the_last_occurrence_of_the_ending_ngram_are_the_draft() -> None:
    #            0  1  2  3  4  5  6  7  8  9
    idx = index([5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert idx.draft(3) == [8, 9, 1]
    assert idx.draft(10) == [8, 9, 1, 5, 6, 7]  # up to the end of the context
    assert idx.draft(0) == []


def test_the_latest_occurrence_and_the_longest_match_win() -> None:
    idx = index([1, 2, 3, 10, 9, 2, 3, 11, 1, 2, 3])
    # "1 2 3" occurred at 0..2 (then 10); "2 3" last at 5..6 (then 11): the longer match wins.
    assert idx.draft(1) == [10]
    idx = index([9, 2, 3, 10, 4, 2, 3, 11, 5, 2, 3])
    assert idx.draft(1) == [11]  # only "2 3" repeats: its latest occurrence


def test_no_repeat_no_draft_and_single_tokens_do_not_count() -> None:
    assert index([1, 2, 3, 4]).draft(4) == []
    assert index([1, 7, 2, 7]).draft(4) == []  # a lone repeated token is not a match
    assert index([]).draft(4) == []


def test_the_index_follows_the_context_as_it_grows() -> None:
    idx = index([1, 2, 3, 4])
    idx.extend([1, 2])
    assert idx.draft(2) == [3, 4]
    idx.extend([3, 9])
    assert idx.draft(2) == []  # "3 9" is new
    idx.extend([1, 2, 3])
    assert idx.draft(1) == [9]  # the latest "1 2 3" went on with 9


def test_whole_acceptance_doubles_the_draft_and_misses_shrink_it_and_pause() -> None:
    spec = Speculation(n_max=16)
    spec.index.extend(list(range(40)) + list(range(10)))
    assert len(spec.propose(100)) == DRAFT_START
    spec.verified(DRAFT_START, DRAFT_START)
    assert len(spec.propose(100)) == 2 * DRAFT_START
    spec.verified(8, 3)
    assert len(spec.propose(100)) == 4  # what was kept, plus one
    assert len(spec.propose(2)) == 2  # never past the room the request leaves
    spec.verified(4, 0)  # missed from the first token: one step without drafting
    assert spec.propose(100) == []
    assert len(spec.propose(100)) == 1
    spec.verified(1, 0)  # missed again: a pause twice as long
    assert [spec.propose(100) for _ in range(2)] == [[], []]
    assert spec.propose(100) != []
    assert spec.drafted == DRAFT_START + 8 + 4 + 1 and spec.accepted == DRAFT_START + 3


def test_pauses_are_bounded_and_a_hit_ends_them() -> None:
    spec = Speculation(n_max=16)
    spec.index.extend([1, 2, 3, 1, 2])
    for _ in range(10):
        spec.verified(1, 0)
    assert spec._cooldown == MAX_COOLDOWN
    spec.verified(1, 1)
    assert spec._cooldown == 0


def test_a_draft_shorter_than_n_min_is_not_worth_a_step() -> None:
    spec = Speculation(n_max=16, n_min=4)
    spec.index.extend([1, 2, 3, 1, 2])
    assert spec.propose(100) == []  # only "3 1 2" follows
    spec = Speculation(n_max=16, n_min=3)
    spec.index.extend([1, 2, 3, 1, 2])
    assert spec.propose(100) == [3, 1, 2]
