"""Crash points for fault tests: kill the operator right after each step of each handler,
between a side effect (on an engine, a pod, the API server) and whatever records it.

POLYKV_OPERATOR_CRASH_AT=<point>:<n> SIGKILLs this process the n-th time <point> is
reached. Unset (always, outside tests) it costs one dictionary lookup. `POINTS` lists every
point, in the order a handler meets them; tests/operator checks each is in the code.
"""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter

log = logging.getLogger("polykv.operator.faults")

ENV = "POLYKV_OPERATOR_CRASH_AT"

POINTS: tuple[str, ...] = (
    # apply_engine: the objects an engine owns, one by one
    "secret-applied",
    "deployment-applied",
    "service-applied",
    # link_parent: computed the child's ownerReference, not yet written
    "pool-linked",
    # the engine round, in order
    "polled",
    "rendered",
    "pool-evicted",
    "pool-created",
    "policy-pushed",
    "gate-written",
    "engine-status-written",
    "pool-status-written",
    # the pool finalizer
    "children-deleted",
    "pool-released",
    "pool-forgotten",
)
_reached: Counter[str] = Counter()


def crash_point(point: str) -> None:
    assert point in POINTS, point
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, count = spec.partition(":")
    if name != point:
        return
    _reached[point] += 1
    if _reached[point] >= int(count or "1"):
        log.warning("crash point %s reached (%d): SIGKILL", point, _reached[point])
        os.kill(os.getpid(), signal.SIGKILL)
