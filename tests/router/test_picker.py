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


def test_higher_projected_tps_wins_then_fewest_sessions_headroom_load_and_name() -> None:
    views = [
        view("a", cap(projected=15.0, n=2)),
        view("b", cap(projected=30.0, n=2)),
        view("c", cap(projected=30.0, n=2, headroom=6)),
        view("d", cap(projected=30.0, n=2, headroom=6), load=1),
        view("e", cap(projected=30.0, n=2, headroom=6), load=1),
    ]
    assert rank(views, {}, gated=True) == ["c", "d", "e", "b", "a"]
    # Within the window the pool's session count comes before headroom.
    views.append(view("f", cap(projected=25.0, n=1)))
    assert rank(views, {}, gated=True) == ["f", "c", "d", "e", "b", "a"]


def test_projections_a_noise_apart_rank_as_equal() -> None:
    # 44 vs 30 tok/s is noise on a busy CPU: the replica with fewer sessions wins; 50 vs 30
    # is a real difference.
    views = [view("busy", cap(projected=44.0, n=2), load=2), view("light", cap(projected=30.0))]
    assert rank(views, {}, gated=True) == ["light", "busy"]
    views = [view("busy", cap(projected=50.0, n=2), load=2), view("light", cap(projected=30.0))]
    assert rank(views, {}, gated=True) == ["busy", "light"]


def test_windows_are_taken_from_the_best_down() -> None:
    # 100 opens the first window (down to 66.7): b and c; 60 opens the next: a and d.
    views = [
        view("a", cap(projected=60.0, n=1)),
        view("b", cap(projected=100.0, n=3)),
        view("c", cap(projected=70.0, n=1)),
        view("d", cap(projected=41.0, n=0)),
    ]
    assert rank(views, {}, gated=True) == ["c", "b", "d", "a"]


def test_identical_replicas_with_noisy_rates_share_new_sessions_evenly() -> None:
    """Six sessions, one at a time, on three alike replicas whose measured rates wobble by
    up to 40% from poll to poll: two each."""
    wobble = [1.0, 1.4, 0.75, 1.2, 0.8, 1.35, 0.9, 1.1, 1.3]
    placed: Counter[str] = Counter()
    for turn in range(6):
        views = [
            view(
                name,
                cap(
                    projected=30.0 * wobble[(turn + i) % len(wobble)] / (placed[name] + 1),
                    n=placed[name],
                )
                if placed[name]
                else cap(projected=None),
            )
            for i, name in enumerate("abc")
        ]
        placed[rank(views, {}, gated=True)[0]] += 1
    assert sorted(placed.values()) == [2, 2, 2], placed


def test_an_idle_pool_ties_with_the_best_projection() -> None:
    # No figure is no evidence of speed: the replica with fewer sessions of the pool wins.
    views = [view("a", cap(projected=500.0, n=1)), view("b", cap(projected=None))]
    assert rank(views, {}, gated=True) == ["b", "a"]
    views = [view("a", cap(projected=500.0, n=0)), view("b", cap(projected=None, n=2))]
    assert rank(views, {}, gated=True) == ["a", "b"]
    # Against slower figures it is in the first window.
    views = [view("a", cap(projected=90.0, n=0)), view("b", cap(projected=None, n=2))]
    views.append(view("c", cap(projected=20.0, n=0)))
    assert rank(views, {}, gated=True) == ["a", "b", "c"]


def test_a_burst_spreads_because_reservations_count() -> None:
    """Four new sessions placed before any poll comes back: two each, not four on one."""
    views = [view("a", cap(headroom=2)), view("b", cap(headroom=2))]
    reserved: Counter[str] = Counter()
    for _ in range(4):
        first = rank(views, reserved, gated=True)[0]
        reserved[first] += 1
    assert reserved == {"a": 2, "b": 2}


def test_reservations_lower_the_projection_by_the_simple_model() -> None:
    # a: 60 tps with 1 session, 1 reserved -> 60 * 2/3 = 40: b's 30 is then in its window,
    # with fewer sessions.
    views = [view("a", cap(projected=60.0, n=1)), view("b", cap(projected=30.0, n=1))]
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
