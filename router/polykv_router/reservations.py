"""In-flight reservations: new sessions sent to a replica that its capacity figures do not
show yet (pure; the caller passes the time).

Capacity is polled, so for up to a poll interval every new session would see the same
figures and go to the same replica. A reservation counts a placement against its replica
and pool from the moment it is sent until a poll that started after the engine accepted it
has come back (that poll counts the session itself), or until it fails, or ages out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Reservation:
    replica: str
    pool: str
    made_at: float
    accepted_at: float | None = None


class Reservations:
    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._live: list[Reservation] = []

    def __len__(self) -> int:
        return len(self._live)

    def add(self, replica: str, pool: str, now: float) -> Reservation:
        r = Reservation(replica, pool, now)
        self._live.append(r)
        return r

    def accepted(self, r: Reservation, now: float) -> None:
        """The engine answered with a success status: the session is on the replica now."""
        r.accepted_at = now

    def release(self, r: Reservation) -> None:
        """The replica refused or failed: nothing to count."""
        if r in self._live:
            self._live.remove(r)

    def observed(self, replica: str, pool: str, poll_started_at: float) -> None:
        """A capacity answer for (replica, pool) that was asked for at ``poll_started_at``
        arrived: it includes every session accepted before that."""
        self._live = [
            r
            for r in self._live
            if not (
                r.replica == replica
                and r.pool == pool
                and r.accepted_at is not None
                and r.accepted_at <= poll_started_at
            )
        ]

    def counts(self, pool: str, now: float) -> Counter[str]:
        """Live reservations per replica for one pool (ageing out the old ones first)."""
        self._live = [r for r in self._live if now - r.made_at <= self.max_age_s]
        return Counter(r.replica for r in self._live if r.pool == pool)
