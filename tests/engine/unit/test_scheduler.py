from polykv_engine.core.scheduler import (
    ActiveSlot,
    Shed,
    ShedView,
    choose_slot,
    may_name,
    pick_shed,
)
from polykv_engine.core.slots import SlotView
from polykv_engine.tokens import common_prefix_len


def slot(
    i: int,
    idle: bool = True,
    session: str | None = None,
    cache: list[int] | None = None,
    used: float = 0.0,
) -> SlotView:
    return SlotView(i, idle, session, cache or [], used)


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2]) == 2


def test_session_returns_to_its_slot_or_waits() -> None:
    slots = [slot(0), slot(1, idle=False, session="a")]
    assert choose_slot(slots, [1], session_slot=1, id_slot=-1, cache_prompt=True) is None
    slots[1] = slot(1, session="a")
    assert choose_slot(slots, [1], session_slot=1, id_slot=-1, cache_prompt=True) == 1


def test_explicit_slot_waits_for_that_slot() -> None:
    slots = [slot(0), slot(1, idle=False)]
    assert choose_slot(slots, [1], None, id_slot=1, cache_prompt=True) is None
    assert choose_slot(slots, [1], None, id_slot=0, cache_prompt=True) == 0


def test_a_tenant_may_name_its_own_slots_and_empty_ones_only() -> None:
    def held(
        tenant: str | None,
        idle: bool = True,
        session: str | None = None,
        cache: list[int] | None = None,
    ) -> SlotView:
        return SlotView(0, idle, session, cache or [], 0.0, tenant)

    assert may_name(held(None), "alpha")
    assert may_name(held("alpha", session="s", cache=[1]), "alpha")
    assert may_name(held("alpha", idle=False), "alpha")
    assert may_name(held("beta"), "alpha")  # beta ran here once; nothing of it is left
    assert not may_name(held("beta", cache=[1, 2]), "alpha")  # its idle cache
    assert not may_name(held("beta", session="s"), "alpha")  # its session
    assert not may_name(held("beta", idle=False), "alpha")  # its running request


def test_longest_cached_prefix_wins() -> None:
    slots = [slot(0, cache=[1, 2]), slot(1, cache=[1, 2, 3, 4]), slot(2)]
    assert choose_slot(slots, [1, 2, 3, 9], None, -1, cache_prompt=True) == 1


def test_a_free_slot_beats_another_sessions_longer_cache() -> None:
    slots = [slot(0, session="other", cache=[1, 2, 3]), slot(1, cache=[9])]
    assert choose_slot(slots, [1, 2, 3, 4], None, -1, cache_prompt=True) == 1
    slots = [slot(0, session="other", cache=[1, 2, 3]), slot(1, idle=False)]
    assert choose_slot(slots, [1, 2, 3, 4], None, -1, cache_prompt=True) == 0


def test_without_cache_reuse_prefer_unowned_then_least_recent() -> None:
    slots = [slot(0, session="s", used=1.0), slot(1, used=5.0), slot(2, used=2.0)]
    assert choose_slot(slots, [1], None, -1, cache_prompt=False) == 2


def test_none_when_every_slot_is_busy() -> None:
    slots = [slot(0, idle=False), slot(1, idle=False)]
    assert choose_slot(slots, [1], None, -1, cache_prompt=True) is None


# --------------------------------------------------------------------------- shedding


def shed_view(
    idle: list[int] | None = None,
    pools: list[int] | None = None,
    builds: list[int] | None = None,
    active: list[ActiveSlot] | None = None,
) -> ShedView:
    return ShedView(idle or [], pools or [], builds or [], active or [])


def test_idle_caches_go_first_least_recently_used_first() -> None:
    view = shed_view(idle=[3, 1], pools=[7], builds=[8], active=[ActiveSlot(0, False, 1.0)])
    assert pick_shed(view) == Shed("drop_cache", 3)


def test_then_idle_pools_then_the_newest_build() -> None:
    view = shed_view(pools=[7, 5], builds=[8], active=[ActiveSlot(0, False, 1.0)])
    assert pick_shed(view) == Shed("evict_pool", 7)
    view = shed_view(builds=[8, 9], active=[ActiveSlot(0, False, 1.0)])
    assert pick_shed(view) == Shed("fail_build", 9)


def test_a_prompt_yields_to_running_sessions() -> None:
    active = [ActiveSlot(0, False, 1.0), ActiveSlot(1, True, 3.0), ActiveSlot(2, True, 2.0)]
    assert pick_shed(shed_view(active=active)) == Shed("defer_prompt", 1)


def test_alone_a_prompt_that_cannot_fit_is_rejected() -> None:
    assert pick_shed(shed_view(active=[ActiveSlot(4, True, 1.0)])) == Shed("reject_prompt", 4)


def test_last_resort_stops_the_youngest_session() -> None:
    active = [ActiveSlot(0, False, 5.0), ActiveSlot(1, False, 2.0)]
    assert pick_shed(shed_view(active=active)) == Shed("stop_session", 0)


def test_nothing_to_shed() -> None:
    assert pick_shed(shed_view()) is None
