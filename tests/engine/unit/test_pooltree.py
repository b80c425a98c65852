import pytest

from polykv_engine.pools.tree import PoolError, PoolTree, chained_hashes


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
    assert (e.value.status, e.value.reason) == (409, "prefix_mismatch")
    with pytest.raises(PoolError, match="beyond the end") as e:
        t.plan_fork(root, [1, 2, 3, 4, 5], 5, None)
    assert e.value.reason == "branch_pos_invalid"
    with pytest.raises(PoolError, match="shares no tokens") as e:
        t.plan_fork(root, [8, 9], None, None)
    assert e.value.reason == "no_common_prefix"
    assert len(t.pools) == 1 and t.seq_ids_used == 1
    t.check_invariants()


def test_on_a_recurrent_model_children_extend_and_branches_are_refused() -> None:
    t = PoolTree(range(10, 14), extend_only=True)
    root = t.add(t.plan_root([1, 2, 3, 4], "root"))
    ext = t.add(t.plan_fork(root, [1, 2, 3, 4, 5], None, "ext"))
    assert ext.branch_pos == root.prefix_len
    for tokens, d in (([1, 2, 7], None), ([1, 2, 3, 4, 5], 2)):  # auto-D short of L, and given
        with pytest.raises(PoolError, match="must extend it") as e:
            t.plan_fork(root, tokens, d, None)
        assert (e.value.status, e.value.reason) == (409, "recurrent_branch")
    assert len(t.pools) == 2
    t.check_invariants()


def test_names_resolve_like_ids_and_are_idempotent() -> None:
    t = tree()
    root = t.add(t.plan_root([1, 2], "a-root"))
    assert t.resolve("a-root") is root and t.resolve(root.pool_id) is root
    assert t.resolve(str(root.pool_id)) is root
    assert t.existing_for("a-root", [1, 2], None) is root
    with pytest.raises(PoolError, match="different prefix") as e:
        t.existing_for("a-root", [1, 3], None)
    assert e.value.reason == "name_conflict"
    with pytest.raises(PoolError, match="not all digits") as e:
        t.existing_for("123", [1], None)
    assert e.value.reason == "name_invalid"
    for bad in ("crew\n", "\ncrew", "crew\r", ""):  # a trailing newline slips past "$"
        with pytest.raises(PoolError, match="is invalid") as e:
            t.existing_for(bad, [1], None)
        assert (e.value.status, e.value.reason) == (400, "name_invalid")
    with pytest.raises(PoolError) as e:
        t.resolve("missing")
    assert (e.value.status, e.value.reason) == (404, "pool_not_found")


def test_sequence_ids_run_out_with_409_and_come_back() -> None:
    t = tree(2)
    a = t.add(t.plan_root([1], None))
    t.add(t.plan_root([2], None))
    with pytest.raises(PoolError, match="--polykv-max-pools") as e:
        t.add(t.plan_root([3], None))
    assert (e.value.status, e.value.reason) == (409, "seq_ids_exhausted") and len(t.pools) == 2
    t.remove(a)
    t.add(t.plan_root([3], None))
    t.check_invariants()


def test_parent_with_children_cannot_be_removed() -> None:
    t = tree()
    root = t.add(t.plan_root([1, 2, 3], "r"))
    child = t.add(t.plan_fork(root, [1, 2, 3, 4], None, "c"))
    with pytest.raises(PoolError, match=r"child pools \(c\)") as e:
        t.remove(root)
    assert e.value.reason == "has_children"
    t.remove(child)
    t.remove(root)
    assert not t.pools
    t.check_invariants()


def test_pre_order_of_the_tree_and_of_a_subtree_after_adds_and_removes() -> None:
    t = tree(8)
    a = t.add(t.plan_root([1, 2], "a"))
    b = t.add(t.plan_root([5, 6], "b"))
    a1 = t.add(t.plan_fork(a, [1, 2, 3], None, "a1"))
    assert [p.name for p in t.parents_first()] == ["a", "a1", "b"]
    t.add(t.plan_fork(b, [5, 6, 7], None, "b1"))
    t.add(t.plan_fork(a1, [1, 2, 3, 4], None, "a11"))
    assert [p.name for p in t.parents_first()] == ["a", "a1", "a11", "b", "b1"]
    assert [p.name for p in t.parents_first(a1)] == ["a1", "a11"]
    t.remove(t.resolve("a11"))
    t.remove(a1)
    assert [p.name for p in t.parents_first()] == ["a", "b", "b1"]
    t.check_invariants()
