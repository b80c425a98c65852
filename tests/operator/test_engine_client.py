"""The engine client's two kinds of failure, and its typed answers."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from polykv_api import models as wire
from polykv_operator.engine_client import EngineClient, EngineRejected, EngineUnreachable

from .fake_engine import FakeEngine


def client(handler) -> EngineClient:  # type: ignore[no-untyped-def]
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return EngineClient(http, "http://10.0.0.1:8080", "secret")


def test_typed_round_trip_and_auth_header() -> None:
    eng = FakeEngine(admin_key="secret")
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.headers["Authorization"])
        return eng(req)

    c = client(handler)

    async def go() -> None:
        made = await c.create(None, wire.PoolCreateRequest(name="root", prompt="hello"))
        assert made.created and made.prefix_len == 5
        first = await c.list_pools()
        assert first.listing is not None and [p.name for p in first.listing.pools] == ["root"]
        # Revalidated with its ETag: unchanged, nothing to parse; changed, the new listing.
        again = await c.list_pools(first.etag)
        assert again.listing is None and again.etag == first.etag and eng.not_modified == 1
        await c.create(None, wire.PoolCreateRequest(name="other", prompt="bye"))
        changed = await c.list_pools(first.etag)
        assert changed.listing is not None and changed.etag != first.etag
        assert [p.name for p in changed.listing.pools] == ["root", "other"]
        assert await c.release("other") is True
        assert await c.release("root") is True
        assert await c.release("root") is False  # 404: nothing to release

    asyncio.run(go())
    assert set(seen) == {"Bearer secret"}


def test_4xx_is_rejected_with_the_engines_message() -> None:
    c = client(FakeEngine(admin_key="secret"))
    with pytest.raises(EngineRejected) as info:
        asyncio.run(c.create("missing", wire.PoolForkRequest(name="x", prompt="y")))
    assert info.value.status == 404 and "does not exist" in info.value.message


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(503, json={"error": {"code": 503, "message": "Loading model", "type": "x"}}),
        httpx.Response(
            401, json={"error": {"code": 401, "message": "Invalid API Key", "type": "x"}}
        ),
        httpx.Response(200, text="not json"),
    ],
)
def test_no_usable_answer_is_unreachable(response: httpx.Response) -> None:
    c = client(lambda req: response)
    with pytest.raises(EngineUnreachable):
        asyncio.run(c.list_pools())


def test_a_key_the_engine_does_not_hold_is_unreachable_not_rejected() -> None:
    """The fake checks the admin key like the engine: another key's create is refused with
    401, an inference key's with 403, and neither is the engine rejecting the pool."""
    for eng in (FakeEngine(admin_key="other"), FakeEngine(admin_key="a", api_key="secret")):
        with pytest.raises(EngineUnreachable, match=r"40[13]"):
            asyncio.run(client(eng).create(None, wire.PoolCreateRequest(name="x", prompt="y")))
        assert not eng.pools


def test_connection_error_is_unreachable() -> None:
    eng = FakeEngine(down=True)
    with pytest.raises(EngineUnreachable, match="ConnectError"):
        asyncio.run(client(eng).list_pools())


@pytest.mark.parametrize(
    ("status", "reason", "refusal"),
    [
        (503, "queue_full", True),
        (503, "kv_full", True),
        (501, "pools_disabled", True),
        (503, "loading", False),
        (500, "internal", False),
    ],
)
def test_a_5xx_with_a_refusal_code_is_an_answer(status: int, reason: str, refusal: bool) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        body = {"error": {"code": status, "message": "no", "type": "x", "reason": reason}}
        return httpx.Response(status, json=body)

    client = EngineClient(
        httpx.AsyncClient(transport=httpx.MockTransport(handler)), "http://e", "k"
    )
    with pytest.raises(EngineRejected if refusal else EngineUnreachable) as info:
        asyncio.run(client.list_pools())
    if refusal:
        assert isinstance(info.value, EngineRejected) and info.value.reason == reason
