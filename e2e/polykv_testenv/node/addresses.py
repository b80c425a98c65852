"""Pod IPs from the loopback range: Linux answers on all of 127.0.0.0/8 without setup,
so every pod can listen on its own address and the same port."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..waiting import port_free


class AddressesExhausted(RuntimeError):
    pass


class AddressPool:
    """Hands out `<prefix>.2` .. `<prefix>.254`, round-robin so a released address is not
    reused at once, skipping any whose wanted ports are taken (another harness may share
    the machine)."""

    def __init__(self, prefix: str = "127.0.0") -> None:
        self.prefix = prefix
        self._used: set[str] = set()
        self._next = 2
        self._lock = threading.Lock()

    def allocate(self, ports: Sequence[int] = ()) -> str:
        with self._lock:
            for _ in range(253):
                n = self._next
                self._next = 2 if n >= 254 else n + 1
                ip = f"{self.prefix}.{n}"
                if ip in self._used or not all(port_free(ip, p) for p in ports):
                    continue
                self._used.add(ip)
                return ip
        raise AddressesExhausted(f"no free address in {self.prefix}.2-254 for ports {ports}")

    def release(self, ip: str) -> None:
        with self._lock:
            self._used.discard(ip)
