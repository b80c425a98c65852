"""Crash points for fault tests (reliability.md, row 1): kill the operator between an engine
side effect and the status or finalizer write that records it.

POLYKV_OPERATOR_CRASH_AT=<point>:<n> SIGKILLs this process the n-th time <point> is
reached. Unset (always, outside tests) it costs one dictionary lookup.
"""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter

log = logging.getLogger("polykv.operator.faults")

ENV = "POLYKV_OPERATOR_CRASH_AT"
_reached: Counter[str] = Counter()


def crash_point(point: str) -> None:
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
