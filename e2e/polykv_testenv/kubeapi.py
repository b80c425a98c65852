"""A small typed Kubernetes REST client over httpx, for the harness and the process node.

Objects are plain JSON dicts. The kubernetes Python package would do, but its models are
untyped here and its watch helper hides resourceVersion handling we need to get right.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("polykv.testenv.kubeapi")

Obj = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class Credentials:
    """How to reach one API server with a client certificate."""

    server: str
    ca_file: Path
    cert_file: Path
    key_file: Path


class ApiError(Exception):
    """A non-2xx answer from the API server; `status` is the HTTP code."""

    def __init__(self, status: int, body: str, method: str, path: str) -> None:
        self.status = status
        self.body = body
        try:
            self.reason = str(json.loads(body).get("reason", ""))
            self.message = str(json.loads(body).get("message", body))
        except ValueError:
            self.reason, self.message = "", body
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}")


class Gone(ApiError):
    """410: the watch's resourceVersion is too old; list again."""


class Kube:
    """Synchronous client. Thread-safe: httpx.Client may be shared between threads."""

    def __init__(self, creds: Credentials, timeout: float = 30.0) -> None:
        self.creds = creds
        # One SSL context carries both the CA and the client certificate (httpx's `cert=`
        # argument is deprecated and ignored once `verify` is a path).
        tls = ssl.create_default_context(cafile=str(creds.ca_file))
        tls.load_cert_chain(str(creds.cert_file), str(creds.key_file))
        self._http = httpx.Client(base_url=creds.server, verify=tls, timeout=timeout)
        self._streams: set[httpx.Response] = set()

    def close(self) -> None:
        # Open watch streams first. A read blocked in another thread only wakes up on
        # shutdown(2) of its socket, not close(2); left alone, it also makes the API server
        # wait for that request when it shuts down.
        for resp in list(self._streams):
            stream = resp.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Obj | list[Any] | None = None,
        params: Mapping[str, str | int] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        content = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        resp = self._http.request(
            method, path, content=content, headers=headers, params=dict(params or {})
        )
        if resp.status_code >= 400:
            cls = Gone if resp.status_code == 410 else ApiError
            raise cls(resp.status_code, resp.text, method, path)
        if not resp.content:
            return {}
        result: Obj = resp.json()
        return result

    def get_text(self, path: str) -> str:
        """For the plain-text endpoints (/readyz, /livez, /version is JSON but small)."""
        resp = self._http.get(path)
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, resp.text, "GET", path)
        return resp.text

    def get(self, path: str, **params: str | int) -> Obj:
        return self.request("GET", path, params=params)

    def create(self, path: str, obj: Obj) -> Obj:
        return self.request("POST", path, body=obj)

    def replace(self, path: str, obj: Obj) -> Obj:
        return self.request("PUT", path, body=obj)

    def patch(self, path: str, patch: Obj, *, content_type: str = MERGE_PATCH) -> Obj:
        return self.request("PATCH", path, body=patch, content_type=content_type)

    def delete(self, path: str, options: Obj | None = None) -> Obj:
        return self.request("DELETE", path, body=options)

    def watch(
        self, path: str, resource_version: str, timeout_s: int = 60, **params: str | int
    ) -> Iterator[Obj]:
        """Yields watch events ({"type", "object"}) until the server ends the stream.

        Raises Gone when the resourceVersion has expired (the caller lists again).
        """
        query: dict[str, str | int] = {
            **params,
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": timeout_s,
        }
        timeout = httpx.Timeout(30.0, read=timeout_s + 30.0)
        with self._http.stream("GET", path, params=query, timeout=timeout) as resp:
            self._streams.add(resp)
            try:
                yield from self._events(resp, path)
            finally:
                self._streams.discard(resp)

    @staticmethod
    def _events(resp: httpx.Response, path: str) -> Iterator[Obj]:
        if resp.status_code >= 400:
            resp.read()
            cls = Gone if resp.status_code == 410 else ApiError
            raise cls(resp.status_code, resp.text, "WATCH", path)
        for line in _json_lines(resp.iter_bytes()):
            event: Obj = json.loads(line)
            if event.get("type") == "ERROR":
                status = event.get("object", {})
                code = int(status.get("code", 500))
                cls = Gone if code == 410 else ApiError
                raise cls(code, json.dumps(status), "WATCH", path)
            yield event


def _json_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The stream's lines, split at b"\\n" only: httpx's ``iter_lines`` also splits at the
    Unicode line breaks (U+0085, U+2028, ...) that the API server writes raw inside JSON
    strings, and one such character in a pod's field (the CRD fuzz test writes them) broke
    that event in two, failed every watch from then on and left the node deaf to new pods."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        yield from (line for line in lines if line.strip())
    if buf.strip():
        yield buf


def pod_path(namespace: str, name: str = "", sub: str = "") -> str:
    path = f"/api/v1/namespaces/{namespace}/pods"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path
