"""Free ports and polling with a deadline."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class NotReady(TimeoutError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now. The OS hands out ephemeral ports in sequence, so a
    port just released is not given to the next caller soon."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout_s: float,
    interval_s: float = 0.2,
    alive: Callable[[], bool] | None = None,
) -> T:
    """Calls `probe` until it returns something other than None (exceptions count as
    "not yet"). `alive` lets a dead process fail the wait at once instead of at timeout."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            result = probe()
            if result is not None:
                return result
        except Exception as exc:
            last_error = exc
        if alive is not None and not alive():
            raise NotReady(f"{what}: process exited (last error: {last_error})")
        if time.monotonic() > deadline:
            raise NotReady(f"{what}: not ready after {timeout_s:.0f}s (last error: {last_error})")
        time.sleep(interval_s)
