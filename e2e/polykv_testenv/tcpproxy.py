"""A TCP relay between a client and a server on loopback, for fault tests: `cut()` closes
every open connection (watches end mid-stream) and refuses new ones until `restore()`.
TLS passes through untouched (the server certificate names 127.0.0.1, whatever the port)."""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading

from .lifecycle import StartStop

log = logging.getLogger("polykv.testenv.tcpproxy")


class TcpProxy(StartStop):
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.target_port = host, target_port
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="tcpproxy", daemon=True)
        self.cuts = 0

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()

    def cut(self) -> None:
        """Close every relayed connection; refuse new ones until restore()."""
        self._cut.set()
        self.cuts += 1
        with self._lock:
            socks, self._open = list(self._open), set()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        log.info("proxy :%d cut (%d sockets)", self.port, len(socks))

    def restore(self) -> None:
        self._cut.clear()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection((self.host, self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        try:
            while True:
                for key, _ in sel.select(timeout=1.0):
                    src = key.fileobj
                    assert isinstance(src, socket.socket)
                    data = src.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
                if self._stop.is_set():
                    return
        except (OSError, ValueError):
            return
        finally:
            sel.close()
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._open -= {a, b}
