"""Anthropic ``cache_control`` breakpoints keep their prefix (``pools.kept``), through the
official ``anthropic`` SDK on the generated model: two sessions and a session that starts
after the first ended read the breakpoint's prefix from KV; it is the tenant's alone; it
goes at its TTL, past the tenant's budget and under KV pressure."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import Usage

from polykv_engine.testing import EngineProcess
from polykv_testenv.waiting import wait_for

from .conftest import DETERMINISTIC

KEYS = "alpha: key-a\nbeta: key-b\n"
ADMIN = {"Authorization": "Bearer admin-key"}
GREEDY = {"temperature": 0}
CREW = "You coordinate a crew of agents. Every one of them reads this briefing first. " * 8


def system(text: str = CREW, **cache: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", **cache}}]


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api.keys"
    path.write_text(KEYS)
    return path


def keyed_engine(
    start_engine: Callable[..., EngineProcess], key_file: Path, *args: str
) -> EngineProcess:
    return start_engine(
        "-np", "2", "-c", "4096", "--api-key-file", str(key_file),
        "--polykv-admin-key", "admin-key", "--polykv-park-mib", "0", *DETERMINISTIC, *args,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(start_engine: Callable[..., EngineProcess], key_file: Path) -> EngineProcess:
    return keyed_engine(start_engine, key_file)


@pytest.fixture
def fresh(engine: EngineProcess) -> Iterator[EngineProcess]:
    """The engine without kept prefixes or cached sessions (released by the admin)."""
    with httpx.Client(base_url=engine.base_url, headers=ADMIN, timeout=60) as c:
        for pool in c.get("/polykv/pools").json()["pools"]:
            assert c.delete(f"/polykv/pools/{pool['pool_id']}").status_code == 200
        for slot in c.get("/slots").json():
            c.post(f"/slots/{slot['id']}?action=erase")
    return engine


def sdk(engine: EngineProcess, key: str = "key-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=engine.base_url, api_key=key, max_retries=0)


def ask(
    engine: EngineProcess,
    session: str,
    words: str | list[dict[str, Any]],
    key: str = "key-a",
    final: bool = False,
    **kw: Any,
) -> Usage:
    headers = {"x-session-id": session, **({"x-session-final": "true"} if final else {})}
    kw.setdefault("system", system())
    kw.setdefault("extra_body", GREEDY)
    msg = sdk(engine, key).messages.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": words}],
        extra_headers=headers, **kw,
    )  # fmt: skip
    return msg.usage


def kept(engine: EngineProcess, key: str | None = None) -> list[dict[str, Any]]:
    """The kept prefixes the caller sees (the admin's view without a key)."""
    headers = {"Authorization": f"Bearer {key}"} if key else ADMIN
    r = httpx.get(f"{engine.base_url}/polykv/pools", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return [p for p in r.json()["pools"] if p["kept_until"] is not None]


def total(u: Usage) -> int:
    return u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0)


def test_sessions_and_a_later_session_read_the_breakpoints_prefix(fresh: EngineProcess) -> None:
    first = ask(fresh, "s1", "Plan the trip.")
    made = first.cache_creation_input_tokens or 0
    assert made >= 64 and first.cache_read_input_tokens == 0, first
    (held,) = kept(fresh, "key-a")
    assert held["prefix_len"] == made and held["name"] is None
    # A second session beside the first reads it (at least: its own slot may share more).
    second = ask(fresh, "s2", "Check the weather.")
    assert (second.cache_read_input_tokens or 0) >= made, second
    assert second.cache_creation_input_tokens == 0
    # Both sessions end (their caches go); one started afterwards reads exactly the prefix.
    ask(fresh, "s1", "Done.", final=True)
    ask(fresh, "s2", "Done.", final=True)
    later = ask(fresh, "s3", "Book the hotel.")
    assert later.cache_read_input_tokens == made and later.cache_creation_input_tokens == 0
    assert later.input_tokens == total(later) - made
    assert len(kept(fresh)) == 1  # every one of them used the one kept prefix
    # A breakpoint further on keeps a longer prefix, built from the first one's cells: only
    # its own part is computed.
    words = [{"type": "text", "text": "Pay the bill.", "cache_control": {"type": "ephemeral"}}]
    deeper = ask(fresh, "s4", words)
    assert deeper.cache_read_input_tokens == made, deeper
    assert 0 < (deeper.cache_creation_input_tokens or 0) < total(deeper) - made
    assert sorted(p["prefix_len"] for p in kept(fresh)) == [
        made,
        made + (deeper.cache_creation_input_tokens or 0),
    ]


def test_a_kept_prefix_is_its_tenants_alone(fresh: EngineProcess) -> None:
    mine = ask(fresh, "a1", "Plan the trip.")
    (held,) = kept(fresh, "key-a")
    # Beta sends the same briefing: nothing of alpha's is read, beta keeps its own.
    theirs = ask(fresh, "b1", "Plan the trip.", key="key-b")
    assert theirs.cache_read_input_tokens == 0
    assert theirs.cache_creation_input_tokens == mine.cache_creation_input_tokens
    assert [p["pool_id"] for p in kept(fresh, "key-a")] == [held["pool_id"]]
    assert len(kept(fresh, "key-b")) == 1 and len(kept(fresh)) == 2  # the admin sees both
    # Alpha's kept prefix by its id, as beta: no such pool, wherever beta asks.
    b = {"Authorization": "Bearer key-b"}
    with httpx.Client(base_url=fresh.base_url, headers=b, timeout=60) as c:
        pool = f"/polykv/pools/{held['pool_id']}"
        for path in (pool, f"{pool}/capacity"):
            r = c.get(path)
            assert r.status_code == 404 and r.json()["error"]["reason"] == "pool_not_found"
    with pytest.raises(anthropic.NotFoundError) as refused:
        ask(fresh, "b2", "Hi.", key="key-b", extra_body={**GREEDY, "pool_id": held["pool_id"]})
    assert refused.value.body["error"]["reason"] == "pool_not_found"  # type: ignore[index]


def test_the_budget_keeps_the_most_recently_used(
    start_engine: Callable[..., EngineProcess], key_file: Path
) -> None:
    eng = keyed_engine(start_engine, key_file, "--polykv-kept-prefixes", "2")
    briefs = [f"Crew {name}: you plan, you check, you book. " * 12 for name in ("red", "blue")]
    briefs.append("Entirely different words about the harbour and its boats. " * 12)
    for i, brief in enumerate(briefs):
        ask(eng, f"s{i}", "Go.", system=system(brief), final=True)
    assert len(kept(eng, "key-a")) == 2
    again = ask(eng, "s4", "Go.", system=system(briefs[0]))  # the least recently used went
    assert (again.cache_creation_input_tokens or 0) > 0
    newest = ask(eng, "s5", "Go.", system=system(briefs[2]))
    assert newest.cache_creation_input_tokens == 0 and (newest.cache_read_input_tokens or 0) > 0


def test_a_kept_prefix_goes_at_its_ttl(
    start_engine: Callable[..., EngineProcess], key_file: Path
) -> None:
    eng = keyed_engine(start_engine, key_file, "--polykv-kept-ttl-max-s", "2")
    first = ask(eng, "t1", "Plan the trip.", system=system(ttl="1h"), final=True)
    made = first.cache_creation_input_tokens or 0
    assert made >= 64
    wait_for("the kept prefix released at its TTL", lambda: kept(eng) == [] or None, timeout_s=120)
    after = ask(eng, "t2", "Plan the trip.", system=system(ttl="1h"))
    assert after.cache_read_input_tokens == 0 and after.cache_creation_input_tokens == made


def test_kv_pressure_releases_a_kept_prefix(
    start_engine: Callable[..., EngineProcess], key_file: Path
) -> None:
    eng = keyed_engine(
        start_engine, key_file, "-c", "1024", "-np", "1", "--polykv-pool-grace-ms", "0"
    )
    ask(eng, "p1", "Plan the trip.", final=True)
    (held,) = kept(eng)
    kept_len = held["prefix_len"]
    # A prompt that needs more cells than the kept prefix left free: it gives them up.
    long = "Harbour, boats and tides, one after another. " * 54
    plain = sdk(eng).messages.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": long}], extra_body=GREEDY
    )
    assert plain.usage.input_tokens > 1024 - kept_len
    assert kept(eng) == []


def test_a_kept_prefix_is_never_written_to_the_snapshot_store(
    start_engine: Callable[..., EngineProcess], key_file: Path, tmp_path: Path
) -> None:
    store = tmp_path / "snapshots"
    eng = keyed_engine(start_engine, key_file, "--polykv-snapshot-dir", str(store))
    ask(eng, "k1", "Plan the trip.")
    wait_for(
        "the kept prefix built",
        lambda: [p for p in kept(eng) if p["residency"] == "resident"] or None,
        timeout_s=120,
    )
    declared = {"name": "crew", "tokens": list(range(5, 105))}
    r = httpx.post(f"{eng.base_url}/polykv/pools", json=declared, headers=ADMIN, timeout=120)
    assert r.status_code == 201, r.text
    # One writer, in order: once the declared pool's file is there, a kept one would be too.
    files = wait_for("the pool's snapshot", lambda: list(store.iterdir()) or None, timeout_s=120)
    assert len(files) == 1
