"""Which headers the router sends upstream and back (pure functions of proxy.py)."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from polykv_router.proxy import downstream_headers, names_replica, upstream_headers


def test_client_copies_of_the_router_only_headers_are_dropped() -> None:
    client = {
        "Authorization": "Bearer k",
        "X-PolyKV-Router-Key": "forged",
        "X-PolyKV-Rehomed": "1",
        "x-session-id": "s",
        "Connection": "keep-alive",
    }
    out = upstream_headers(client, {"x-polykv-router-key": "real"})
    assert dict(out) == {
        "Authorization": "Bearer k",
        "x-session-id": "s",
        "x-polykv-router-key": "real",
    }
    assert "x-polykv-rehomed" not in upstream_headers(client, {})


def test_a_refusal_names_no_replica() -> None:
    up = CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"}))
    for status in (401, 403, 429, 500, 502, 503):
        assert not names_replica(status)
        assert "x-polykv-replica" not in downstream_headers(up, "pod-a", status)
    for status in (200, 201, 400, 404, 409):
        assert downstream_headers(up, "pod-a", status)["x-polykv-replica"] == "pod-a"
