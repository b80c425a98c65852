import pytest

from polykv_engine.kv.cells import KVModel


def test_kv_model_shares_and_frees_by_membership() -> None:
    kv = KVModel()
    kv.append(10, 100)  # a pool prefix
    for s in (0, 1, 2):
        kv.copy(10, s, 0, 100)
        kv.append(s, 5)
    assert kv.used == 115
    kv.clear(10)  # releasing the pool keeps cells the sessions still hold
    assert kv.used == 115
    kv.clear(0)
    assert kv.used == 110
    assert kv.common_cells(1, 2) == 100
    assert kv.shared_from(1, 0) and not kv.shared_from(1, 100)


def test_kv_model_ownership_partitions_used_cells() -> None:
    kv = KVModel()
    kv.append(10, 50)  # root [0, 50)
    kv.copy(10, 11, 0, 30)  # branch at 30
    kv.append(11, 20)
    kv.copy(11, 0, 0, 50)
    kv.append(0, 7)
    rank = {10: (0, 1), 11: (0, 2), 0: (1, 0)}.__getitem__  # pools oldest first, then sessions
    owners = kv.owners(rank)
    assert owners == {10: 50, 11: 20, 0: 7}
    assert sum(owners.values()) == kv.used
    assert {seq: kv.owned(seq, rank) for seq in (10, 11, 0)} == owners  # one at a time agrees


def test_kv_model_ownership_follows_rank_not_who_computed_the_cells() -> None:
    kv = KVModel()
    kv.append(0, 30)  # a session computed 30 cells
    kv.copy(0, 12, 0, 30)  # a pool snapshot of it shares all of them
    kv.copy(0, 1, 0, 20)  # a second session shares the first 20
    kv.append(1, 4)
    rank = {12: (0, 5), 0: (1, 0), 1: (1, 1)}.__getitem__
    assert kv.owners(rank) == {12: 30, 1: 4}  # the pool owns what it holds
    assert kv.owned(0, rank) == 0 and kv.owned(1, rank) == 4 and kv.owned(12, rank) == 30
    kv.clear(12)  # without the pool the lowest-numbered session owns the shared run
    assert kv.owners(rank) == {0: 30, 1: 4} and kv.owned(1, rank) == 4
    kv.clear(0)
    assert kv.owned(1, rank) == 24 == kv.used


def test_kv_model_rejects_non_contiguous_copy() -> None:
    kv = KVModel()
    kv.append(1, 5)
    with pytest.raises(ValueError):
        kv.copy(1, 2, 2, 4)
    kv.remove_range(1, 1, 3)
    assert kv.length(1) == 3 and kv.used == 3


def test_kv_model_replace_swaps_own_cells_for_the_sources() -> None:
    kv = KVModel()
    kv.append(10, 40)  # a pool computed after the session
    kv.append(0, 60)  # the session computed the same 40 tokens, then 20 of its own
    assert kv.used == 100 and kv.common_cells(0, 10) == 0
    kv.replace(10, 0, 0, 40)
    assert kv.common_cells(0, 10) == 40 and kv.length(0) == 60
    assert kv.used == 60  # the session's private copy of the prefix is freed
    assert kv.owners({10: (0, 1), 0: (1, 0)}.__getitem__) == {10: 40, 0: 20}
    with pytest.raises(ValueError):
        kv.replace(10, 0, 30, 50)  # the pool holds no position 40


def test_private_from_is_where_a_sequences_own_tail_starts() -> None:
    m = KVModel()
    m.append(0, 5)
    assert m.private_from(0) == 0  # all its own
    m.copy(0, 1, 0, 3)  # seq 1 shares the first three cells
    m.append(1, 2)
    assert m.private_from(0) == 3 and m.private_from(1) == 3
    m.copy(0, 2, 0, 5)  # seq 2 shares all of seq 0: nothing of seq 0 is private
    assert m.private_from(0) == 5
    assert m.private_from(9) == 0  # an empty sequence
