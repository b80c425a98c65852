"""The conversations kept for ``previous_response_id`` (pure): per tenant, bounded by count
and bytes with the least recently used out first, released with their session."""

from __future__ import annotations

from polykv_api.models import ChatMessage
from polykv_engine.http.response_store import ResponseStore, Stored, size_of


def stored(session: str, text: str) -> Stored:
    history = (ChatMessage(role="user", content=text),)
    return Stored(session, history, size_of(history))


def test_a_response_is_found_only_by_its_tenant() -> None:
    store = ResponseStore()
    store.put("alice", "resp_1", stored("s", "secret"))
    assert store.get("alice", "resp_1") is not None
    assert store.get("bob", "resp_1") is None


def test_bounds_drop_the_least_recently_used() -> None:
    store = ResponseStore(max_entries=2, max_bytes=10)
    store.put("t", "a", stored("s", "aaaa"))
    store.put("t", "b", stored("s", "bbbb"))
    assert store.get("t", "a") is not None  # now the most recently used
    store.put("t", "c", stored("s", "cccc"))  # over both bounds: b goes
    assert [store.get("t", k) is not None for k in "abc"] == [True, False, True]
    store.put("t", "d", stored("s", "d" * 8))  # 16 bytes with a and c: both go
    assert store.get("t", "a") is None and store.get("t", "c") is None and len(store) == 1
    store.put("t", "e", stored("s", "e" * 11))  # larger than the whole store: not kept
    assert store.get("t", "e") is None and store.get("t", "d") is not None


def test_a_released_session_takes_its_responses() -> None:
    store = ResponseStore()
    for key, session in (("r1", "s1"), ("r2", "s1"), ("r3", "s2")):
        store.put("t", key, stored(session, key))
    store.put("other", "r4", stored("s1", "x"))
    assert store.forget_session("t", "s1") == 2
    assert store.get("t", "r3") is not None and store.get("other", "r4") is not None
