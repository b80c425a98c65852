"""The picker (pure): which replicas a new session or a re-home tries, in which order."""

from __future__ import annotations

from collections import Counter

from polykv_router.picker import PoolCapacity, ReplicaView, rank


def cap(
    can_admit: bool = True,
    projected: float | None = None,
    headroom: int = 4,
    n: int = 0,
    reason: str = "ok",
) -> PoolCapacity:
    return PoolCapacity(can_admit, reason, projected, headroom, n)


def view(name: str, c: PoolCapacity | None = None, **kw: object) -> ReplicaView:
    return ReplicaView(name, kw.pop("serving", True), c, **kw)  # type: ignore[arg-type]


def test_a_saturated_replica_goes_last_and_admitting_ones_first() -> None:
    views = [view("a", cap(can_admit=False, reason="tps_floor")), view("b", cap()), view("c")]
    assert rank(views, {}, gated=True) == ["b", "c", "a"]


def test_higher_projected_tps_wins_then_headroom_then_load_then_name() -> None:
    views = [
        view("a", cap(projected=20.0, n=2)),
        view("b", cap(projected=30.0, n=2)),
        view("c", cap(projected=30.0, n=2, headroom=6)),
        view("d", cap(projected=30.0, n=2, headroom=6), load=1),
        view("e", cap(projected=30.0, n=2, headroom=6), load=1),
    ]
    assert rank(views, {}, gated=True) == ["c", "d", "e", "b", "a"]


def test_an_idle_pool_beats_any_projection() -> None:
    views = [view("a", cap(projected=500.0, n=1)), view("b", cap(projected=None))]
    assert rank(views, {}, gated=True) == ["b", "a"]


def test_a_burst_spreads_because_reservations_count() -> None:
    """Four new sessions placed before any poll comes back: two each, not four on one."""
    views = [view("a", cap(headroom=2)), view("b", cap(headroom=2))]
    reserved: Counter[str] = Counter()
    for _ in range(4):
        first = rank(views, reserved, gated=True)[0]
        reserved[first] += 1
    assert reserved == {"a": 2, "b": 2}


def test_reservations_lower_the_projection_by_the_simple_model() -> None:
    # a: 40 tps with 1 session, 1 reserved -> 40 * 2/3 = 26.7 < b's 30.
    views = [view("a", cap(projected=40.0, n=1)), view("b", cap(projected=30.0, n=1))]
    assert rank(views, {}, gated=True) == ["a", "b"]
    assert rank(views, {"a": 1}, gated=True) == ["b", "a"]


def test_headroom_used_up_by_reservations_comes_after_unknown_capacity() -> None:
    views = [view("a", cap(headroom=1)), view("b")]
    assert rank(views, {"a": 1}, gated=True) == ["b", "a"]


def test_not_serving_replicas_are_never_candidates() -> None:
    views = [view("a", cap(), serving=False), view("b", cap(can_admit=False))]
    assert rank(views, {}, gated=True) == ["b"]
    assert rank([view("a", serving=False)], {}, gated=True) == []


def test_replicas_without_the_pool_are_left_out_unless_none_has_it() -> None:
    views = [view("a", None, has_pool=False), view("b", cap())]
    assert rank(views, {}, gated=True) == ["b"]
    # Nobody has it: the least loaded answers, so the engine's 404 reaches the client.
    nobody = [view("a", None, has_pool=False, load=3), view("b", None, has_pool=False)]
    assert rank(nobody, {}, gated=True) == ["b", "a"]


def test_a_rehome_ignores_can_admit_but_not_headroom() -> None:
    views = [
        view("a", cap(can_admit=False, headroom=3)),
        view("b", cap(can_admit=True, headroom=0)),
        view("c"),
    ]
    assert rank(views, {}, gated=True) == ["c", "b", "a"]
    assert rank(views, {}, gated=False) == ["a", "c", "b"]


def test_the_replica_to_avoid_is_tried_last() -> None:
    views = [view("a", cap(projected=None)), view("b", cap(projected=10.0, n=3))]
    assert rank(views, {}, gated=False, avoid="a") == ["b", "a"]
    assert rank(views, {}, gated=False, avoid="gone") == ["a", "b"]


def test_without_a_pool_the_lightest_replica_comes_first() -> None:
    views = [view("a", load=2), view("b", load=0), view("c", load=1)]
    assert rank(views, {}, gated=False) == ["b", "c", "a"]
