"""The background poll: each replica's boot id and its capacity for every pool requested
recently, into the fleet records; each answer retires the reservations it accounts for.

One round per interval asks every replica concurrently (``GET /props`` and one
``GET /polykv/pools/{pool}/capacity`` per recent pool); a replica that does not answer keeps
its last figures, which go stale (the picker then treats them as unknown). The first
request for a pool nobody has asked about yet waits for one immediate round for that pool
(``warm``), so it is not placed blind.

Only pools named by requests whose key an engine accepted get here (``keycheck``), and at
most ``max_pools`` of them: past that the least recently requested one is no longer polled,
and every replica forgets its figures for a pool no longer polled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .engines import EngineError, Engines
from .fleet import Fleet, PoolAnswer, Replica
from .reservations import Reservations

log = logging.getLogger("polykv.router.capacity")


class CapacityPoller:
    def __init__(
        self,
        fleet: Fleet,
        engines: Engines,
        reservations: Reservations,
        interval_s: float,
        pool_idle_s: float,
        max_pools: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.engines = engines
        self.reservations = reservations
        self.interval_s = interval_s
        self.pool_idle_s = pool_idle_s
        self.max_pools = max_pools
        self.clock = clock
        self.hot: dict[str, float] = {}  # pool -> when a request last named it
        self._warming: dict[str, asyncio.Task[None]] = {}

    def want(self, pool: str) -> None:
        self.hot.pop(pool, None)  # to the end: the dict is least recently requested first
        self.hot[pool] = self.clock()
        while len(self.hot) > self.max_pools:
            del self.hot[next(iter(self.hot))]

    def known(self, pool: str) -> bool:
        return any(pool in r.pools for r in self.fleet)

    async def warm(self, pool: str, timeout_s: float) -> None:
        """Marks the pool as wanted; if no replica has been asked about it yet, asks them all
        now and waits (at most ``timeout_s``) for the answers."""
        self.want(pool)
        if self.known(pool):
            return
        task = self._warming.get(pool)
        if task is None:
            task = asyncio.create_task(self._poll_pool(pool))
            self._warming[pool] = task
            task.add_done_callback(lambda _: self._warming.pop(pool, None))
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            log.info("capacity of a new pool not known in time", extra={"fields": {"pool": pool}})

    async def run(self) -> None:
        while True:
            t0 = self.clock()
            try:
                await self.round()
            except Exception:  # a bug here must not stop the poll for good
                log.exception("capacity round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - t0)))

    async def round(self) -> None:
        now = self.clock()
        for pool, seen in list(self.hot.items()):
            if now - seen > self.pool_idle_s:
                del self.hot[pool]
        pools = list(self.hot)
        for r in self.fleet:
            for gone in r.pools.keys() - self.hot.keys():
                del r.pools[gone]
        await asyncio.gather(*(self._poll_replica(r, pools) for r in self.fleet))

    async def _poll_pool(self, pool: str) -> None:
        await asyncio.gather(*(self._poll_one(r, pool) for r in self.fleet))

    async def _poll_replica(self, r: Replica, pools: list[str]) -> None:
        try:
            boot = await self.engines.boot_id(r.pod)
        except EngineError as exc:
            log.debug("no boot id: %s", exc)
        else:
            if r.boot_id is not None and boot != r.boot_id:
                log.info(
                    "engine restarted",
                    extra={"fields": {"pod": r.name, "old_boot_id": r.boot_id, "boot_id": boot}},
                )
                r.pools.clear()  # answers from the old process say nothing about this one
            r.boot_id = boot
        await asyncio.gather(*(self._poll_one(r, pool) for pool in pools))

    async def _poll_one(self, r: Replica, pool: str) -> None:
        started = self.clock()
        try:
            cap = await self.engines.capacity(r.pod, pool)
        except EngineError as exc:
            log.debug("no capacity: %s", exc)
            return
        if self.fleet.get(r.name) is not r:
            return  # the replica was replaced meanwhile
        r.pools[pool] = PoolAnswer(self.clock(), cap)
        self.reservations.observed(r.name, pool, started)
