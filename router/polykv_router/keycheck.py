"""The router's door: a client's credentials are checked with an engine before the router
does anything for the request (a session lookup on every replica, a capacity poll, a
proxied request).

The engines stay the authority: the check is one read-only engine call with the client's
own headers, its answer is cached per key fingerprint (``verdicts``), and a proxied request
is checked by its engine again anyway. Concurrent requests with the same unseen key wait
for one check; at most ``max_checks`` checks run at a time, whatever the number of
distinct keys thrown at the router.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from .engines import EngineError, Engines
from .fleet import Fleet
from .metrics import Metrics
from .verdicts import KeyVerdicts, credentials, fingerprint

log = logging.getLogger("polykv.router.keys")


class NoReplica(Exception):
    """No replica answered the key check: the router cannot tell, so it does not serve."""


class KeyCheck:
    def __init__(
        self,
        fleet: Fleet,
        engines: Engines,
        verdicts: KeyVerdicts,
        metrics: Metrics,
        max_checks: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.engines = engines
        self.verdicts = verdicts
        self.metrics = metrics
        self.clock = clock
        self._running: dict[str, asyncio.Task[bool]] = {}
        self._slots = asyncio.Semaphore(max_checks)

    async def accepted(self, headers: Mapping[str, str]) -> bool:
        """Whether the engines accept this request's credentials (none at all included:
        an engine without keys accepts that). NoReplica when none could be asked."""
        creds = credentials(headers)
        key = fingerprint(creds)
        known = self.verdicts.get(key, self.clock())
        if known is not None:
            return known
        task = self._running.get(key)
        if task is None:
            task = asyncio.create_task(self._check(key, creds))
            self._running[key] = task
            task.add_done_callback(lambda _: self._running.pop(key, None))
        return await asyncio.shield(task)

    async def _check(self, key: str, creds: dict[str, str]) -> bool:
        async with self._slots:
            # Serving replicas first; one that cannot answer passes the question on.
            replicas = sorted(self.fleet, key=lambda r: (not r.pod.serving, r.in_flight, r.name))
            for r in replicas:
                try:
                    ok = await self.engines.accepts(r.pod, creds)
                except EngineError as exc:
                    self.metrics.key_checks.labels("unanswered").inc()
                    log.debug("key check failed: %s", exc)
                    continue
                self.metrics.key_checks.labels("accepted" if ok else "refused").inc()
                self.verdicts.put(key, ok, self.clock())
                return ok
        raise NoReplica("no engine replica answered the key check")
