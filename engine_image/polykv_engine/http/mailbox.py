"""Engine-thread events into the asyncio loop, one wake-up per burst.

Every decode step hands each running request a token. Waking the loop once per event (a
self-pipe write and a loop iteration each) costs a syscall per stream per step; a mailbox
per loop collects a step's events and wakes the loop once, and the loop hands them out in
the order they were posted.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[Any], *items: Any) -> None:
        """Any thread: ``items`` reach ``queue`` on the loop in order, after everything
        posted before them."""
        with self._lock:
            self._items.extend((queue, item) for item in items)
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = (
    weakref.WeakKeyDictionary()
)
_CREATE = threading.Lock()


def mailbox(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The loop's mailbox (made on first use)."""
    with _CREATE:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = LoopMailbox(loop)
        return box
