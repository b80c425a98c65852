"""Engine-thread events into the asyncio loop, one wake-up per burst; and the engine thread
waiting for the loop to take its turn.

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
from collections.abc import Callable
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


def loop_turns(loop: asyncio.AbstractEventLoop, turns: int = 8) -> Callable[[float], None]:
    """A function for another thread: ``wait(timeout_s)`` returns once ``loop`` has run
    everything that was ready when it was called (and what that made ready, ``turns``
    deep), or after ``timeout_s``: request handlers already started reach the engine."""

    def wait(timeout_s: float) -> None:
        done = threading.Event()

        def turn(left: int) -> None:
            if left <= 1:
                done.set()
            else:
                loop.call_soon(turn, left - 1)

        try:
            loop.call_soon_threadsafe(turn, turns)
        except RuntimeError:  # the loop is closed: nobody is arriving
            return
        done.wait(timeout_s)

    return wait
