"""Kept prefixes: the prefix up to an Anthropic ``cache_control`` breakpoint, kept for the
TTL the client asked (pure policy; ``core.pool_ops.keep_prefix`` applies it).

A kept prefix is an implicit pool: unnamed, owned by one tenant (only its requests attach
it, only it and the admin see it listed), seeded copy-free from the tenant's kept prefix
that shares most with it, so a prefix common to many breakpoints is held once. Later
requests of the tenant (other sessions, or a session started after the first ended) attach
the kept prefix that shares most with their prompt and read those tokens from KV. It goes:

* at its TTL (``ttl`` ``5m``, the default, or ``1h``; capped by ``--polykv-kept-ttl-max-s``),
  counted from the later of its last request and the moment it is built (a build slower
  than the TTL, a long prompt on a loaded CPU, must not expire before its request reads it);
* when its tenant keeps more than ``--polykv-kept-prefixes`` of them (least recently used
  first);
* when a declared pool needs its sequence id (declared pools come first);
* under KV pressure, like any idle pool past its grace time.

Sessions that hold its cells keep them; only the prefix's own hold goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polykv_engine.pools.tree import Pool
from polykv_engine.tokens import common_prefix_len

TTL_S = {"5m": 300.0, "1h": 3600.0}  # Anthropic's two TTLs; no ttl means 5m
KEEP_MIN_TOKENS = 64  # a shorter prefix is computed again faster than a sequence id is spent


@dataclass(frozen=True, slots=True)
class KeepAsk:
    """Keep ``tokens`` for ``tenant`` ``ttl_s`` seconds past now and past being built."""

    tenant: str
    tokens: list[int]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Kept:
    """The kept prefix a request attaches, and how many of its tokens are computed for it
    now (0: it was kept already, and the request reads them)."""

    pool_id: int
    computed: int


def ttl_s(ttl: str | None, cap_s: float) -> float:
    return min(TTL_S[ttl or "5m"], cap_s)


def extend(pool: Pool, ttl_s: float, now: float) -> None:
    """A request asked for ``pool`` to be kept ``ttl_s`` from ``now``."""
    pool.kept_ttl_s = max(pool.kept_ttl_s, ttl_s)
    pool.kept_until = max(pool.kept_until, now + ttl_s)


def built(pool: Pool, now: float) -> None:
    """``pool`` is in KV now: its TTL starts again, for the requests that waited on it."""
    if pool.kept:
        extend(pool, pool.kept_ttl_s, now)


def closest(kept: Sequence[Pool], tokens: Sequence[int]) -> tuple[Pool | None, int]:
    """The kept prefix sharing the most leading tokens with ``tokens`` (a materializing one
    too: it is a seed once built), and how many; (None, 0) when none shares any."""
    best, n = None, 0
    for pool in kept:
        if len(pool.tokens) > n:
            d = common_prefix_len(pool.tokens, tokens)
            if d > n:
                best, n = pool, d
    return best, n


def over_budget(kept: Sequence[Pool], budget: int, keep: Pool | None) -> list[Pool]:
    """The tenant's kept prefixes to release so that one more fits within ``budget``: the
    least recently used resident ones, never ``keep`` (the new one's seed) nor one still
    materializing (a request waits on it)."""
    excess = len(kept) + 1 - budget
    if excess <= 0:
        return []
    idle = [p for p in kept if p is not keep and p.residency == "resident"]
    return sorted(idle, key=lambda p: p.last_access_ts)[:excess]


def expired(pools: Sequence[Pool], now: float) -> list[Pool]:
    return [p for p in pools if p.kept and p.kept_until <= now and p.residency == "resident"]
