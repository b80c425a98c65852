"""What the router knows about each engine replica (pure records, no clients, no clock).

Written by discovery (pods), the capacity poller (boot id, capacity per pool) and the
request path (requests in flight); read by the picker through ``views``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from .picker import PoolCapacity, ReplicaView
from .pods import Pod


@dataclass(frozen=True, slots=True)
class PoolAnswer:
    """The last capacity answer for one pool: figures, or the pool is missing there."""

    at: float
    capacity: PoolCapacity | None
    """None: the replica answered 404 pool_not_found."""


@dataclass(slots=True)
class Replica:
    pod: Pod
    boot_id: str | None = None
    """The engine process's boot id (from /props); it changes when the process restarts."""
    pools: dict[str, PoolAnswer] = field(default_factory=dict)
    in_flight: int = 0

    @property
    def name(self) -> str:
        return self.pod.name


class Fleet:
    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, name: str) -> Replica | None:
        return self._replicas.get(name)

    def upsert(self, pod: Pod) -> None:
        """A pod appeared or changed. A new uid or address is a new replica: what we knew of
        the old one (boot id, capacity) does not carry over."""
        old = self._replicas.get(pod.name)
        if old is None or old.pod.uid != pod.uid or old.pod.base_url != pod.base_url:
            self._replicas[pod.name] = Replica(pod)
        else:
            old.pod = pod

    def remove(self, name: str) -> None:
        self._replicas.pop(name, None)

    def replace(self, pods: Iterable[Pod]) -> None:
        """A full listing: pods not in it are gone."""
        fresh = {p.name: p for p in pods}
        for name in list(self._replicas):
            if name not in fresh:
                del self._replicas[name]
        for pod in fresh.values():
            self.upsert(pod)

    def views(
        self, pool: str | None, bound: Mapping[str, int], now: float, max_age_s: float
    ) -> list[ReplicaView]:
        """Each replica as the picker sees it for ``pool``; answers older than
        ``max_age_s`` count as unknown."""
        out = []
        for r in self._replicas.values():
            cap: PoolCapacity | None = None
            has_pool = True
            answer = r.pools.get(pool) if pool is not None else None
            if answer is not None and now - answer.at <= max_age_s:
                cap = answer.capacity
                has_pool = cap is not None
            load = bound.get(r.name, 0) + r.in_flight
            out.append(ReplicaView(r.name, r.pod.serving, cap, has_pool, load))
        return out

    def counts(self) -> dict[str, int]:
        """Replicas by state, for the metrics: serving, terminating, not ready."""
        out = {"serving": 0, "terminating": 0, "not_ready": 0}
        for r in self._replicas.values():
            state = (
                "terminating" if r.pod.terminating else "serving" if r.pod.ready else "not_ready"
            )
            out[state] += 1
        return out
