"""The kept-prefix policy (``pools.kept``, pure): which kept prefix a request reads, which
go past the tenant's budget, which have expired, and when their TTL starts."""

from __future__ import annotations

from polykv_engine.pools.kept import built, closest, expired, extend, over_budget
from polykv_engine.pools.tree import Pool, chained_hashes


def kept(pool_id: int, tokens: list[int], last: float, **kw: object) -> Pool:
    pool = Pool(pool_id, None, None, 0, tokens, chained_hashes(tokens), residency="resident")
    pool.owner, pool.kept_until, pool.last_access_ts = "t", 100.0, last
    for k, v in kw.items():
        setattr(pool, k, v)
    return pool


def test_the_closest_kept_prefix_shares_the_most_leading_tokens() -> None:
    short, longer = kept(1, [1, 2, 3], 0), kept(2, [1, 2, 3, 4, 9], 0)
    assert closest([short, longer], [1, 2, 3, 4, 5]) == (longer, 4)
    assert closest([short, longer], [1, 2]) == (short, 2)  # the first of equals
    assert closest([short, longer], [7]) == (None, 0)
    building = kept(3, [1, 2, 3, 4, 5, 6], 0, residency="materializing")
    assert closest([short, building], [1, 2, 3, 4, 5, 6]) == (building, 6)


def test_past_the_budget_the_least_recently_used_resident_ones_go() -> None:
    old, mid, new = kept(1, [1], 1.0), kept(2, [2], 2.0), kept(3, [3], 3.0)
    assert over_budget([old, mid, new], 4, None) == []
    assert over_budget([old, mid, new], 3, None) == [old]
    assert over_budget([old, mid, new], 2, None) == [old, mid]
    assert over_budget([old, mid, new], 3, old) == [mid]  # the new one's seed stays
    old.residency = "materializing"  # a request waits on it
    assert over_budget([old, mid, new], 3, None) == [mid]


def test_only_kept_prefixes_past_their_time_expire() -> None:
    due, later = kept(1, [1], 0, kept_until=10.0), kept(2, [2], 0, kept_until=20.0)
    declared = Pool(3, "crew", None, 0, [3], chained_hashes([3]), residency="resident")
    assert expired([due, later, declared], 15.0) == [due]
    assert expired([due, later, declared], 20.0) == [due, later]


def test_the_ttl_starts_again_when_the_prefix_is_built() -> None:
    """A build slower than the TTL (a long prompt on a loaded CPU) does not expire before
    the request that waited on it reads it: the TTL counts from the build's end too."""
    pool = kept(1, [1], 0, residency="materializing", kept_until=0.0)
    extend(pool, 300.0, now=1000.0)  # asked at 1000 for 5 minutes
    assert pool.kept_until == 1300.0
    built(pool, now=1900.0)  # the build took 15 minutes
    assert pool.kept_until == 2200.0 and expired([pool], 2100.0) == []
    extend(pool, 60.0, now=2000.0)  # a shorter ask never shortens it
    assert (pool.kept_until, pool.kept_ttl_s) == (2200.0, 300.0)
    declared = Pool(2, "crew", None, 0, [2], chained_hashes([2]), residency="resident")
    built(declared, now=5000.0)
    assert declared.kept_until == 0.0
