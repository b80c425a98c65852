"""Session → replica bindings: a cache with an idle TTL (pure; the caller passes the time).

The engines are the truth (each knows its own sessions); this table only saves asking them.
A miss is answered by asking every replica (routing.py), so a restarted router, or a second
router replica, finds the same replica.

A session is keyed by whose credentials named it as well as by its id, as the engines key
theirs by tenant: two tenants that both call a session "main" have two sessions, and one
tenant's binding never routes (or re-homes) the other's turns.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

SessionKey = tuple[str, str]
"""(the fingerprint of the client's credentials, the session id)."""


@dataclass(slots=True)
class Binding:
    replica: str
    """The engine pod's name."""
    uid: str
    """The pod's uid: a new pod of the same name is another replica."""
    boot_id: str | None
    """The engine process the session's KV lives in; another boot id means it is gone."""
    pool: str | None
    """The pool the session attached to (to place it again if its replica goes)."""
    last_used: float


class Bindings:
    """Least recently used first, so expiry walks only what has expired; at most
    ``max_sessions`` (a new one past that drops the least recently used: it is asked for
    again on its next turn)."""

    def __init__(self, ttl_s: float, max_sessions: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._table: OrderedDict[SessionKey, Binding] = OrderedDict()
        self._per_replica: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._table)

    def get(self, session: SessionKey, now: float) -> Binding | None:
        b = self._table.get(session)
        if b is None:
            return None
        if now - b.last_used > self.ttl_s:
            self.drop(session)
            return None
        return b

    def bind(self, session: SessionKey, binding: Binding) -> None:
        self.drop(session)
        self._table[session] = binding
        self._per_replica[binding.replica] += 1
        while len(self._table) > self.max_sessions:
            self.drop(next(iter(self._table)))

    def touch(self, session: SessionKey, now: float) -> None:
        b = self._table.get(session)
        if b is not None:
            b.last_used = now
            self._table.move_to_end(session)

    def drop(self, session: SessionKey) -> None:
        b = self._table.pop(session, None)
        if b is not None:
            self._per_replica[b.replica] -= 1
            if self._per_replica[b.replica] <= 0:
                del self._per_replica[b.replica]

    def expire(self, now: float) -> int:
        """Drops bindings idle for longer than the TTL; returns how many."""
        n = 0
        while self._table:
            session, b = next(iter(self._table.items()))
            if now - b.last_used <= self.ttl_s:
                break
            self.drop(session)
            n += 1
        return n

    def per_replica(self) -> Counter[str]:
        """Sessions bound to each replica (a replica's share of sleeping agents)."""
        return self._per_replica
