"""Parking: an idle session's private cells leave the unified cache while other sessions
compute (they would otherwise widen every decode's attention window), and come back at the
same positions for the session's next turn, a memcpy instead of a prefill.

Checked on the generated model with f32 KV: the next turn reuses the whole previous context
and answers exactly as a fresh computation; llama.cpp's own used-cell count agrees with the
shadow model throughout; the budget drops the least recently used parked cache first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from polykv_engine.testing import EngineProcess

from .conftest import DETERMINISTIC, greedy
from .pool_helpers import ADMIN, check_accounting, listing

TOPICS = ("rivers and their deltas", "old lighthouses", "winter markets", "paper kites")


def text(i: int, n: int = 12) -> str:
    """Prompts that differ from their first word: only the BOS cell is shared."""
    return f"{TOPICS[i % len(TOPICS)].capitalize()}, said session {i}. " * n


def metric(c: httpx.Client, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def turn(c: httpx.Client, session: str, prompt: str, n: int = 16) -> dict[str, object]:
    r = c.post("/completion", json=greedy(prompt, n, session_id=session), headers=ADMIN)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


@pytest.fixture(scope="module")
def parking_engine(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    return start_engine(
        "-np", "3", "-c", "4096", "--polykv-kv-debug", "--metrics",
        "--polykv-admin-key", "admin-key", *DETERMINISTIC,
    )  # fmt: skip


@pytest.fixture
def pk(parking_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=parking_engine.base_url, timeout=120) as c:
        for slot in c.get("/slots", headers=ADMIN).json():
            assert c.post(f"/slots/{slot['id']}?action=erase", headers=ADMIN).status_code == 200
        yield c


def test_an_idle_cache_is_parked_while_others_compute_and_its_next_turn_reuses_it(
    pk: httpx.Client,
) -> None:
    first = turn(pk, "a", text(0))
    used_by_a = listing(pk)["kv_cells_used"]
    parked0 = metric(pk, "polykv_kv_parked_tokens_total")
    b = turn(pk, "b", text(1), n=64)  # b computes: a's cells leave the cache
    lst = check_accounting(pk)  # llama.cpp's own count agrees with the shadow model
    bpt = lst["kv_bytes_per_token"]
    a_tokens = int(first["tokens_evaluated"]) + 16 - 1  # type: ignore[call-overload]
    b_tokens = int(b["tokens_evaluated"]) + 64 - 1  # type: ignore[call-overload]
    assert used_by_a == a_tokens
    # All of a's cells but the BOS one it shares with b are out of the cache, in host memory.
    assert metric(pk, "polykv_kv_parked_tokens_total") - parked0 == a_tokens - 1
    assert metric(pk, "polykv_kv_parked_bytes") >= (a_tokens - 1) * bpt
    assert lst["kv_cells_used"] == b_tokens
    a_cells = [s for s in lst["unpooled_sessions"] if s["session_id"] == "a"]
    assert not a_cells or a_cells[0]["marginal_kv_bytes"] <= bpt

    # a's next turn: its whole context comes back and the answer is the fresh one.
    follow = text(0) + str(first["content"]) + " And then?"
    unparked0 = metric(pk, "polykv_kv_unparked_tokens_total")
    again = turn(pk, "a", follow)
    assert int(again["timings"]["cache_n"]) >= a_tokens  # type: ignore[index]
    assert metric(pk, "polykv_kv_unparked_tokens_total") - unparked0 == a_tokens - 1
    fresh = pk.post("/completion", json=greedy(follow, 16, cache_prompt=False)).json()
    assert again["tokens"] == fresh["tokens"]
    check_accounting(pk)


def test_a_parked_cache_serves_a_pool_snapshot_of_its_session(pk: httpx.Client) -> None:
    turn(pk, "snap", text(2))
    turn(pk, "other", text(3), n=32)  # parks snap's cells
    assert metric(pk, "polykv_kv_parked_bytes") > 0
    r = pk.post("/polykv/pools", json={"from_session": "snap", "name": "snap"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["prefix_len"] >= 16
    check_accounting(pk)
    assert pk.delete("/polykv/pools/snap", headers=ADMIN).status_code == 200


def test_erase_drops_a_parked_cache(pk: httpx.Client) -> None:
    turn(pk, "e", text(1))
    turn(pk, "f", text(2), n=32)
    assert metric(pk, "polykv_kv_parked_bytes") > 0
    for slot in pk.get("/slots", headers=ADMIN).json():
        assert pk.post(f"/slots/{slot['id']}?action=erase", headers=ADMIN).status_code == 200
    assert metric(pk, "polykv_kv_parked_bytes") == 0
    assert listing(pk)["kv_cells_used"] == 0


def test_the_budget_drops_the_least_recently_used_parked_cache(
    start_engine: Callable[..., EngineProcess],
) -> None:
    eng = start_engine(
        "-np", "3", "-c", "8192", "--polykv-park-mib", "1", "--metrics",
        "--polykv-admin-key", "admin-key", *DETERMINISTIC,
    )  # fmt: skip
    with httpx.Client(base_url=eng.base_url, timeout=120) as c:
        bpt = listing(c)["kv_bytes_per_token"]
        per_rep = len(c.post("/tokenize", json={"content": text(0, 1)}).json()["tokens"])
        reps = max(1, int(0.6 * (1 << 20) / bpt) // per_rep)  # a cache of ~0.6 MiB: one fits
        turn(c, "old", text(0, reps))
        turn(c, "new", text(1, reps))  # parks old
        assert metric(c, "polykv_kv_park_dropped_tokens_total") == 0
        turn(c, "third", "A short one.", n=8)  # parks new: old must go to make room
        assert metric(c, "polykv_kv_park_dropped_tokens_total") > 0
        assert metric(c, "polykv_kv_parked_bytes") <= 1 << 20
        unparked = metric(c, "polykv_kv_unparked_tokens_total")
        turn(c, "new", text(1, reps) + " More.")  # still parked: comes back
        assert metric(c, "polykv_kv_unparked_tokens_total") > unparked
        again = turn(c, "old", text(0, reps) + " More.")  # was dropped: computed again
        assert int(again["timings"]["cache_n"]) <= 1  # type: ignore[index]


def test_park_mib_0_keeps_idle_caches_resident(
    start_engine: Callable[..., EngineProcess],
) -> None:
    eng = start_engine(
        "-np", "2", "-c", "4096", "--polykv-park-mib", "0", "--metrics",
        "--polykv-admin-key", "admin-key", *DETERMINISTIC,
    )  # fmt: skip
    with httpx.Client(base_url=eng.base_url, timeout=120) as c:
        turn(c, "a", text(0))
        used = listing(c)["kv_cells_used"]
        turn(c, "b", text(1))
        assert metric(c, "polykv_kv_parked_tokens_total") == 0
        assert listing(c)["kv_cells_used"] > used  # a's cells stayed beside b's
