"""The loop mailbox: events from another thread arrive in order, one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from polykv_engine.core.tasks import ErrorEvent, Event, TokenEvent
from polykv_engine.http.mailbox import loop_turns, mailbox
from polykv_engine.http.routes.inference import QueueSink


@contextmanager
def counting_wakes(loop: asyncio.AbstractEventLoop) -> Iterator[list[int]]:
    """Counts the loop's cross-thread wake-ups (``call_soon_threadsafe``) in ``[n]``."""
    wakes = [0]
    real = loop.call_soon_threadsafe

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        wakes[0] += 1
        return real(*args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
    try:
        yield wakes
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]


def test_a_burst_from_another_thread_arrives_in_order_with_one_wake_up() -> None:
    async def main() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        box = mailbox(loop)
        assert mailbox(loop) is box  # one per loop
        a: asyncio.Queue[int] = asyncio.Queue()
        b: asyncio.Queue[int] = asyncio.Queue()
        with counting_wakes(loop) as wakes:

            def engine_step() -> None:  # what a decode step of two streams posts
                for i in range(50):
                    box.post(a, i)
                    box.post(b, 100 + i)

            t = threading.Thread(target=engine_step)
            t.start()
            t.join()  # the loop is not running meanwhile: all 100 posts are one burst
            got_a = [await a.get() for _ in range(50)]
            got_b = [await b.get() for _ in range(50)]
        return got_a, got_b, wakes[0]

    got_a, got_b, wakes = asyncio.run(main())
    assert got_a == list(range(50)) and got_b == list(range(100, 150))
    assert wakes == 1


def test_a_whole_response_wakes_the_loop_once_a_stream_per_burst() -> None:
    async def main(stream: bool) -> tuple[list[Event], int]:
        loop = asyncio.get_running_loop()
        sink = QueueSink(loop, stream)
        with counting_wakes(loop) as wakes:
            for i in range(5):  # five decode steps, the loop draining after each
                sink.emit(TokenEvent(text=f"t{i}", token=i))
                await asyncio.sleep(0)
            sink.emit(ErrorEvent(500, "server_error", "stopped"))
            got = [await sink.queue.get() for _ in range(6)]
        assert sink.queue.empty()
        return got, wakes[0]

    for stream, expected_wakes in ((False, 1), (True, 6)):
        got, wakes = asyncio.run(main(stream))
        assert [e.token for e in got[:5] if isinstance(e, TokenEvent)] == list(range(5))
        assert isinstance(got[5], ErrorEvent) and wakes == expected_wakes, (stream, wakes)


def test_a_stream_sends_its_first_token_at_once_then_at_most_every_interval() -> None:
    now = [0.0]

    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        sink = QueueSink(loop, True, interval_s=0.02, clock=lambda: now[0])
        handed: list[list[int]] = []

        async def drain() -> None:  # what the loop received at each wake-up
            await asyncio.sleep(0)
            got = []
            while not sink.queue.empty():
                ev = sink.queue.get_nowait()
                got.append(ev.token if isinstance(ev, TokenEvent) else -1)
            if got:
                handed.append(got)

        with counting_wakes(loop) as wakes:
            for i, t in enumerate((0.0, 0.005, 0.010, 0.021, 0.030, 0.035)):
                now[0] = t  # one decode step every few ms
                sink.emit(TokenEvent(text=f"t{i}", token=i))
                await drain()
            sink.flush()  # the engine is about to run someone's prefill
            await drain()
            sink.flush()  # nothing held: no wake-up
            now[0] = 0.036
            sink.emit(TokenEvent(text="t6", token=6))  # held: the last send was at 0.035
            sink.emit(ErrorEvent(500, "server_error", "stopped"))  # takes what is held along
            await drain()
        return handed, wakes[0]

    handed, wakes = asyncio.run(main())
    assert handed == [[0], [1, 2, 3], [4, 5], [6, -1]]
    assert wakes == 4


def test_a_whole_response_ignores_flush_until_its_end() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        sink = QueueSink(loop, False, interval_s=0.0)
        with counting_wakes(loop) as wakes:
            sink.emit(TokenEvent(text="a", token=1))
            sink.flush()
            await asyncio.sleep(0)
            assert sink.queue.empty()
            sink.emit(ErrorEvent(500, "server_error", "stopped"))
            await asyncio.sleep(0)
            assert sink.queue.qsize() == 2
        return wakes[0]

    assert asyncio.run(main()) == 1


def _loop_in_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def _close(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


def test_loop_turns_returns_after_handlers_already_started_reached_their_end() -> None:
    loop, thread = _loop_in_thread()
    try:
        submitted: list[int] = []

        async def handler(i: int) -> None:  # reads, parses, tokenizes: a few loop iterations
            for _ in range(3):
                await asyncio.sleep(0)
            submitted.append(i)

        wait = loop_turns(loop)
        ready = threading.Event()

        def start_burst() -> None:  # what one select() of readable requests starts
            for i in range(4):
                loop.create_task(handler(i))
            ready.set()

        loop.call_soon_threadsafe(start_burst)
        assert ready.wait(30)
        wait(30.0)  # the limit is far; the turns end it
        assert submitted == [0, 1, 2, 3]
    finally:
        _close(loop, thread)


def test_loop_turns_gives_up_at_its_limit_on_a_blocked_loop_and_on_a_closed_one() -> None:
    loop, thread = _loop_in_thread()
    release = threading.Event()
    try:
        loop.call_soon_threadsafe(release.wait, 60)  # a handler that holds the loop
        wait = loop_turns(loop)
        done = threading.Event()

        def waiter() -> None:
            wait(0.05)
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        assert done.wait(30), "loop_turns waited past its limit on a blocked loop"
        assert not release.is_set()  # it returned while the loop was still blocked
    finally:
        release.set()
        _close(loop, thread)
    loop_turns(loop)(30.0)  # closed: returns at once, raises nothing
