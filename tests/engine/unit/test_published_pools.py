"""The engine publishes pools incrementally; after any sequence of changes the published view
must equal one built from scratch."""

import random

from polykv_api.models import AdmissionPolicy
from polykv_engine.core.snapshot import PoolSnapshot, PublishedPools
from polykv_engine.pools.tree import PoolTree


def from_scratch(t: PoolTree) -> tuple[list[PoolSnapshot], dict[object, PoolSnapshot]]:
    snaps = [
        PoolSnapshot(p.pool_id, p.name, p.prefix_len, p.residency, p.admission)
        for p in t.pools.values()
    ]
    index: dict[object, PoolSnapshot] = {s.pool_id: s for s in snaps}
    index.update({s.name: s for s in snaps if s.name is not None})
    return snaps, index


def test_published_pools_follow_every_change_and_reuse_unchanged_views() -> None:
    t = PoolTree(range(100, 140))
    published = PublishedPools()
    rng = random.Random(7)
    names = [f"p{i}" for i in range(12)]
    for step in range(600):
        live = list(t.pools.values())
        op = rng.random()
        if op < 0.35 and len(live) < 30:
            name = rng.choice([*names, None])
            if name is None or name not in {p.name for p in live}:
                parent = rng.choice([None, *live])
                if parent is None:
                    t.add(t.plan_root([step, 1, 2], name))
                else:
                    t.add(t.plan_fork(parent, [*parent.tokens, step], None, name))
        elif op < 0.6 and live:
            leaves = [p for p in live if not p.children]
            t.remove(rng.choice(leaves))  # frees its name for a newer pool
        elif op < 0.8 and live:
            pool = rng.choice(live)
            t.set_residency(pool, rng.choice(["resident", "evicted", "materializing"]))
        elif live:
            pool = rng.choice(live)
            pool.admission = AdmissionPolicy(target_tps_per_session=rng.choice([1.0, 2.0]))
            t.mark(pool)
        if rng.random() < 0.5:  # the engine publishes at its own pace, not after every change
            pools, index = published.update(t)
            assert (list(pools), dict(index)) == from_scratch(t), f"step {step}"
            again = published.update(t)
            assert again[0] is pools and again[1] is index  # nothing changed: nothing copied
        t.check_invariants()


def test_a_view_already_published_does_not_change_afterwards() -> None:
    t = PoolTree(range(10, 14))
    published = PublishedPools()
    a = t.add(t.plan_root([1, 2], "a"))
    first_pools, first_index = published.update(t)
    t.set_residency(a, "resident")
    t.add(t.plan_root([3], "b"))
    pools, index = published.update(t)
    assert [p.residency for p in first_pools] == ["materializing"] and "b" not in first_index
    assert [(p.name, p.residency) for p in pools] == [("a", "resident"), ("b", "materializing")]
    assert index["b"] is pools[1] and index[a.pool_id] is pools[0]
