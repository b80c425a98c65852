"""Heavy request work off the event loop: decoding large bodies, chat templates, grammar
compilation and tokenizing run on a few worker threads, so /health and every other request
keep being answered while a 30 MiB body is tokenized.

The threads get a large stack of their own (``threading.stack_size`` at creation): llama.cpp's
GBNF parser and Jinja recurse, and a deep input must end in a refusal, never a stack
overflow. Work for a small request stays inline: handing it over costs more than doing it;
but a grammar always goes to a worker, however small its text (what llama.cpp builds from a
few hundred bytes can take it a while: the bounds keep that well under a second, and it is
not the event loop's to wait).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

# Inline below this many body bytes. Measured on 2 cores (test model): handing work to a
# worker and back costs ~0.1 ms; tokenizing 4 KiB of text takes ~1 ms, and a 4 KiB body's
# JSON, template and grammar work less, so the loop is never held more than a few ms.
INLINE_BYTES = 4096
WORKER_THREADS = 2
WORKER_STACK_BYTES = 256 << 20  # virtual: only the pages a deep recursion touches are used

_stack_size_lock = threading.Lock()


class LargeStackExecutor(concurrent.futures.Executor):
    """A fixed set of threads, each started with ``stack_bytes`` of stack."""

    def __init__(self, threads: int = WORKER_THREADS, stack_bytes: int = WORKER_STACK_BYTES):
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        with _stack_size_lock:  # stack_size is process-wide: set it only around our starts
            previous = threading.stack_size(stack_bytes)
            try:
                for i in range(threads):
                    t = threading.Thread(target=self._work, name=f"polykv-offload-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            finally:
                threading.stack_size(previous)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        if kwargs:
            raise TypeError("LargeStackExecutor.submit takes positional arguments only")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for t in self._threads:
                t.join()


WORKER = web.AppKey("polykv_offload", LargeStackExecutor)


async def offload(
    request: web.Request, size: int, fn: Callable[..., T], *args: Any, inline: bool = True
) -> T:
    """``fn(*args)`` on a worker thread when the request is large (``size`` bytes) or may
    not run inline, inline otherwise; its result or exception either way."""
    if inline and size <= INLINE_BYTES:
        return fn(*args)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[WORKER], fn, *args)
