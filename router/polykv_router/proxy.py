"""One request to one replica, relayed to the client unchanged: status, headers (but the
hop-by-hop ones) and body bytes, an SSE stream chunk by chunk as the engine writes it.

A refusal (429, or 503 while the engine loads, drains or has no KV left) is returned to the
caller instead of relayed, so it can try another replica; so is a replica that cannot be
reached. Nothing has been written to the client in either case.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from .errors import Refusal, engine_reason, retry_after_s
from .names import REHOMED_HEADER, REPLICA_HEADER, ROUTER_KEY_HEADER
from .pods import Pod

# RFC 9110 §7.6.1 connection-specific fields, plus what aiohttp recomputes for each hop.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "proxy-authenticate",
        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "host",
        "content-length", "date", "server",
    }
)  # fmt: skip
# The router has read the body already (no Expect), and only it may mark a re-home or
# speak as the router.
REQUEST_DROP = HOP_BY_HOP | {"expect", REHOMED_HEADER, ROUTER_KEY_HEADER}
REFUSED_503 = frozenset({"shutting_down", "loading", "kv_full"})
WHOLE_BODY_MAX = 1 << 20  # a response with a known length up to this is read whole


@dataclass(frozen=True, slots=True)
class Relayed:
    response: web.StreamResponse
    status: int
    replica: str


@dataclass(frozen=True, slots=True)
class Refused:
    refusal: Refusal


@dataclass(frozen=True, slots=True)
class Unreachable:
    error: str


Outcome = Relayed | Refused | Unreachable


def upstream_headers(headers: Mapping[str, str], extra: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in headers.items() if k.lower() not in REQUEST_DROP
    )
    out.update(extra)
    return out


def names_replica(status: int) -> bool:
    """A refusal (401, 403, 429, 5xx) does not say which replica refused: it would tell an
    unauthenticated or throttled client the fleet's layout."""
    return status < 500 and status not in (401, 403, 429)


def downstream_headers(
    headers: CIMultiDictProxy[str], replica: str, status: int
) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP
    )
    out.popall(REPLICA_HEADER, None)
    if names_replica(status):
        out[REPLICA_HEADER] = replica
    return out


class Proxy:
    def __init__(
        self, http: aiohttp.ClientSession, connect_timeout_s: float, router_key: str | None
    ) -> None:
        self.http = http
        self.identity = {ROUTER_KEY_HEADER: router_key} if router_key else {}
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s
        )

    async def forward(
        self,
        request: web.Request,
        body: bytes,
        pod: Pod,
        extra: Mapping[str, str] | None = None,
        on_accept: Callable[[int], None] | None = None,
    ) -> Outcome:
        """Sends the request to ``pod``. ``on_accept(status)`` runs once the replica has
        answered with anything but a refusal, before the body is relayed."""
        headers = upstream_headers(request.headers, {**self.identity, **(extra or {})})
        url = pod.base_url + request.raw_path
        for attempt in (1, 2):
            try:
                up = await self.http.request(
                    request.method, url, data=body, headers=headers,
                    timeout=self.timeout, allow_redirects=False,
                )  # fmt: skip
                break
            except aiohttp.ClientConnectorError as exc:
                return Unreachable(f"connect: {exc}")
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # A pooled keep-alive connection the engine had closed: one fresh try.
                if attempt == 2:
                    return Unreachable(f"disconnected: {exc!r}")
            except TimeoutError:
                return Unreachable("connect timeout")
        try:
            if up.status == 429 or up.status == 503:
                raw = await up.read()
                reason = engine_reason(raw)
                if up.status == 429 or reason in REFUSED_503:
                    after = retry_after_s(up.headers.get("Retry-After"))
                    return Refused(Refusal(pod.name, up.status, reason or "refused", after))
                if on_accept is not None:
                    on_accept(up.status)
                headers = downstream_headers(up.headers, pod.name, up.status)
                resp = web.Response(status=up.status, body=raw, headers=headers)
                return Relayed(resp, up.status, pod.name)
            if on_accept is not None:
                on_accept(up.status)
            return Relayed(await self._relay(request, up, pod), up.status, pod.name)
        except BaseException:
            up.close()  # the client went away mid-stream: the engine sees it and stops
            raise
        finally:
            up.release()

    async def _relay(
        self, request: web.Request, up: aiohttp.ClientResponse, pod: Pod
    ) -> web.StreamResponse:
        headers = downstream_headers(up.headers, pod.name, up.status)
        length = up.content_length
        if length is not None and length <= WHOLE_BODY_MAX:
            return web.Response(status=up.status, body=await up.read(), headers=headers)
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        if length is not None:
            resp.content_length = length
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp
