import pytest

from polykv_engine.kvmodel import KVModel
from polykv_engine.pooltree import PoolError, PoolTree, chained_hashes


def tree(n: int = 4) -> PoolTree:
    return PoolTree(range(10, 10 + n))


def test_chained_hash_fingerprints_every_prefix() -> None:
    a = chained_hashes([1, 2, 3, 4])
    b = chained_hashes([1, 2, 9, 4])
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    assert chained_hashes([1, 2, 3, 4], a[:2]) == a  # resumable from any position


def test_extend_and_branch_positions() -> None:
    t = tree()
    root = t.add(t.plan_root([1, 2, 3, 4], "root"))
    ext = t.add(t.plan_fork(root, [1, 2, 3, 4, 5, 6], None, "ext"))
    br = t.add(t.plan_fork(root, [1, 2, 7], None, "br"))
    assert (ext.branch_pos, br.branch_pos) == (4, 2)
    assert root.children == {ext.pool_id, br.pool_id}
    assert [p.name for p in t.parents_first()] == ["root", "ext", "br"]
    assert t.depth(ext) == 1
    t.check_invariants()


def test_contract_violations_raise_409_before_any_change() -> None:
    t = tree()
    root = t.add(t.plan_root([1, 2, 3, 4], "root"))
    with pytest.raises(PoolError, match="position 1") as e:
        t.plan_fork(root, [1, 9, 3], 3, None)
    assert e.value.status == 409
    with pytest.raises(PoolError, match="beyond the end"):
        t.plan_fork(root, [1, 2, 3, 4, 5], 5, None)
    with pytest.raises(PoolError, match="shares no tokens"):
        t.plan_fork(root, [8, 9], None, None)
    assert len(t.pools) == 1 and t.seq_ids_used == 1
    t.check_invariants()


def test_names_resolve_like_ids_and_are_idempotent() -> None:
    t = tree()
    root = t.add(t.plan_root([1, 2], "a-root"))
    assert t.resolve("a-root") is root and t.resolve(root.pool_id) is root
    assert t.resolve(str(root.pool_id)) is root
    assert t.existing_for("a-root", [1, 2], None) is root
    with pytest.raises(PoolError, match="different prefix"):
        t.existing_for("a-root", [1, 3], None)
    with pytest.raises(PoolError, match="not all digits"):
        t.existing_for("123", [1], None)
    with pytest.raises(PoolError) as e:
        t.resolve("missing")
    assert e.value.status == 404


def test_sequence_ids_run_out_with_409_and_come_back() -> None:
    t = tree(2)
    a = t.add(t.plan_root([1], None))
    t.add(t.plan_root([2], None))
    with pytest.raises(PoolError, match="--polykv-max-pools") as e:
        t.add(t.plan_root([3], None))
    assert e.value.status == 409 and len(t.pools) == 2
    t.remove(a)
    t.add(t.plan_root([3], None))
    t.check_invariants()


def test_parent_with_children_cannot_be_removed() -> None:
    t = tree()
    root = t.add(t.plan_root([1, 2, 3], "r"))
    child = t.add(t.plan_fork(root, [1, 2, 3, 4], None, "c"))
    with pytest.raises(PoolError, match=r"child pools \(c\)"):
        t.remove(root)
    t.remove(child)
    t.remove(root)
    assert not t.pools
    t.check_invariants()


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
    owners = kv.owners([("root", 10, 0), ("branch", 11, 30), ("s0", 0, 0)])
    assert owners == {"root": 50, "branch": 20, "s0": 7}
    assert sum(owners.values()) == kv.used


def test_kv_model_rejects_non_contiguous_copy() -> None:
    kv = KVModel()
    kv.append(1, 5)
    with pytest.raises(ValueError):
        kv.copy(1, 2, 2, 4)
    kv.remove_range(1, 1, 3)
    assert kv.length(1) == 3 and kv.used == 3
