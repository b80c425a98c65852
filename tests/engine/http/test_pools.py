"""Pools through HTTP on a real model: sharing is exact, accounting is physical, errors are 4xx."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest

from polykv_engine.testing import EngineProcess

from .conftest import DETERMINISTIC, greedy
from .pool_helpers import (
    ADMIN,
    check_accounting,
    complete,
    create,
    fork,
    listing,
    release_all,
    tokenize,
)
from .test_completion import sse_events

SYSTEM = (
    "You are one of many agents working on a shared codebase. The team rules: keep changes "
    "small, test everything for real, and write down what you measured. " * 3
)
TOOLS_A = "Tools: search(query), read(path), write(path, text). "
TOOLS_B = "Tools: shell(cmd), browse(url). "


@pytest.fixture(scope="module")
def pool_engine(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    return start_engine(
        "-np", "4", "-c", "4096", "--polykv-max-pools", "6", "--polykv-kv-debug",
        "--api-key", "infer-key", "--polykv-admin-key", "admin-key", *DETERMINISTIC,
    )  # fmt: skip


@pytest.fixture
def pc(pool_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=pool_engine.base_url, timeout=120) as c:
        release_all(c)
        for slot in c.get("/slots", headers=ADMIN).json():  # no caches left by earlier tests
            r = c.post(f"/slots/{slot['id']}?action=erase", headers=ADMIN)
            assert r.status_code == 200, r.text
        yield c
        release_all(c)


def unpooled(c: httpx.Client, prompt: object, n: int = 32) -> str:
    r = complete(c, prompt, n, cache_prompt=False)
    assert r.status_code == 200, r.text
    return str(r.json()["content"])


def test_pooled_output_equals_unpooled_for_root_extend_and_branch(pc: httpx.Client) -> None:
    root = create(pc, prompt=SYSTEM, name="root")
    ext = fork(pc, "root", prompt=SYSTEM + TOOLS_A, name="ext")
    branch_text = SYSTEM[:200] + TOOLS_B
    br = fork(pc, "root", prompt=branch_text, name="branch")
    assert ext["branch_pos"] >= root["prefix_len"] - 1  # extend (up to a BPE boundary merge)
    assert 0 < br["branch_pos"] < root["prefix_len"]  # COW branch inside the root
    assert br["pool"]["parent_name"] == "root" and br["pool"]["path"] == "root/branch"
    check_accounting(pc)
    for name, text in (("root", SYSTEM), ("ext", SYSTEM + TOOLS_A), ("branch", branch_text)):
        prompt = text + "Task: summarise the rules."
        r = complete(pc, prompt, 32, pool_id=name, cache_prompt=False)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["content"] == unpooled(pc, prompt), name
        assert body["polykv"]["pool_id"] is not None
        assert int(r.headers["x-cached-prefix-tokens"]) == body["timings"]["cache_n"] > 0
        check_accounting(pc)


def test_attach_prefills_only_the_suffix(pc: httpx.Client) -> None:
    prefix = tokenize(pc, SYSTEM)
    suffix = tokenize(pc, " and then some private context", add_special=False)
    p = create(pc, tokens=prefix, name="tok-root")
    assert p["prefix_len"] == len(prefix) and p["branch_pos"] == 0
    # cache_prompt off: only the pool may supply cached tokens, nothing from old slot caches.
    r = complete(
        pc, prefix + suffix, 8, pool_id=p["pool_id"], session_id="s-suffix", cache_prompt=False
    )
    t = r.json()["timings"]
    assert t["cache_n"] == len(prefix)
    assert t["prompt_n"] == len(suffix)
    lst = check_accounting(pc)
    (pool,) = lst["pools"]
    (sess,) = pool["sessions"]
    assert sess["session_id"] == "s-suffix" and sess["shared_prefix_tokens"] == len(prefix)
    bpt = lst["kv_bytes_per_token"]
    assert pool["own_kv_bytes"] == len(prefix) * bpt
    # The session's private cells: its suffix plus the tokens it generated (last not decoded).
    assert sess["marginal_kv_bytes"] == (len(suffix) + 8 - 1) * bpt
    # Explicit P, consistent with the prompt: accepted.
    r = complete(pc, prefix + suffix, 4, pool_id="tok-root", shared_prefix_n_tokens=10)
    assert r.status_code == 200


def test_a_session_that_cached_the_prefix_first_joins_the_pool(pc: httpx.Client) -> None:
    prefix = tokenize(pc, SYSTEM)
    prompt = prefix + tokenize(pc, " my own question", add_special=False)
    # The session computes the prefix itself, before any pool holds it.
    first = complete(pc, prompt, 4, session_id="early")
    assert first.status_code == 200, first.text
    create(pc, tokens=prefix, name="late-pool")
    r = complete(pc, prompt, 4, pool_id="late-pool", session_id="early")
    assert r.status_code == 200, r.text
    assert r.json()["timings"]["cache_n"] >= len(prefix)  # its own cache still counts
    assert r.json()["tokens"] == first.json()["tokens"]
    lst = check_accounting(pc)
    (pool,) = lst["pools"]
    (sess,) = pool["sessions"]  # linked to the pool, so admission counts it there
    assert sess["session_id"] == "early" and sess["shared_prefix_tokens"] == len(prefix)
    assert lst["unpooled_sessions"] == []
    # One copy of the prefix (the pool's), not two.
    assert lst["kv_cells_used"] < 2 * len(prefix)


def test_kv_is_stored_once_for_many_sessions(pc: httpx.Client) -> None:
    prefix = tokenize(pc, SYSTEM)
    create(pc, tokens=prefix, name="shared")
    for i in range(4):
        suffix = tokenize(pc, f" session {i} asks", add_special=False)
        r = complete(pc, prefix + suffix, 4, pool_id="shared", session_id=f"many-{i}")
        assert r.json()["timings"]["cache_n"] >= len(prefix)
    lst = check_accounting(pc)
    assert len(lst["pools"][0]["sessions"]) == 4
    # One prefix plus four short private tails, not four prefixes.
    assert lst["kv_cells_used"] < 2 * len(prefix)


def test_fork_contract_violations_change_nothing(pc: httpx.Client) -> None:
    root = create(pc, prompt=SYSTEM, name="c-root")
    toks = tokenize(pc, SYSTEM)
    before = listing(pc)
    bad = list(toks)
    bad[5] = (bad[5] + 1) % 200
    cases = [
        ({"tokens": [*bad, 1, 2], "branch_pos": 20}, "at position 5"),
        ({"tokens": [*toks, 1], "branch_pos": root["prefix_len"] + 3}, "beyond the end"),
        ({"tokens": [7, 8, 9]}, "shares no tokens"),
    ]
    for body, needle in cases:
        r = pc.post("/polykv/pools/c-root/fork", json=body, headers=ADMIN)
        assert r.status_code == 409, r.text
        assert needle in r.json()["error"]["message"]
    after = listing(pc)
    assert [p["pool_id"] for p in after["pools"]] == [p["pool_id"] for p in before["pools"]]
    assert after["kv_cells_used"] == before["kv_cells_used"]
    # The attach contract: an explicit P that the prompt does not match.
    r = complete(pc, [1, 2, 3, 4, 5], 4, pool_id="c-root", shared_prefix_n_tokens=4)
    assert r.status_code == 409 and "differs from pool" in r.json()["error"]["message"]


def test_release_ordering_unknown_ids_and_names(pc: httpx.Client) -> None:
    create(pc, prompt=SYSTEM, name="o-root")
    fork(pc, "o-root", prompt=SYSTEM + TOOLS_A, name="o-child")
    r = pc.delete("/polykv/pools/o-root", headers=ADMIN)
    assert r.status_code == 409 and "o-child" in r.json()["error"]["message"]
    for path in ("/polykv/pools/9999", "/polykv/pools/nope"):
        r = pc.get(path, headers=ADMIN)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert pc.delete(path, headers=ADMIN).status_code == 404
        assert pc.post(f"{path}/pin", headers=ADMIN).status_code == 404
    r = complete(pc, "x", 2, pool_id="nope")
    assert r.status_code == 404
    assert pc.delete("/polykv/pools/o-child", headers=ADMIN).status_code == 200
    assert pc.delete("/polykv/pools/o-root", headers=ADMIN).status_code == 200
    assert listing(pc)["pools"] == []
    check_accounting(pc)


def test_names_are_idempotent_and_unique(pc: httpx.Client) -> None:
    a = create(pc, prompt=SYSTEM, name="same")
    b = create(pc, expect=200, prompt=SYSTEM, name="same")
    assert b["created"] is False and b["pool_id"] == a["pool_id"]
    r = pc.post("/polykv/pools", json={"prompt": SYSTEM + "x", "name": "same"}, headers=ADMIN)
    assert r.status_code == 409 and "different prefix" in r.json()["error"]["message"]
    fork(pc, "same", prompt=SYSTEM + TOOLS_A, name="kid")
    again = fork(pc, "same", expect=200, prompt=SYSTEM + TOOLS_A, name="kid")
    assert again["created"] is False
    assert len(listing(pc)["pools"]) == 2


def test_seq_id_exhaustion_is_409_and_creates_nothing(pc: httpx.Client) -> None:
    for i in range(6):
        create(pc, tokens=[10 + i, 11, 12], name=f"ex-{i}")
    before = listing(pc)
    r = pc.post("/polykv/pools", json={"tokens": [99, 98], "name": "ex-6"}, headers=ADMIN)
    assert r.status_code == 409
    assert "--polykv-max-pools" in r.json()["error"]["message"]
    assert listing(pc)["pools"] == before["pools"]
    check_accounting(pc)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "exactly one of"),
        ({"tokens": [1], "prompt": "x"}, "exactly one of"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
        ({"prompt": "x", "name": "has space"}, "invalid"),
        ({"prompt": "x", "name": "12345"}, "not all digits"),
        ({"tokens": [-1]}, "tokens"),
        ({"tokens": [10**8]}, "outside the vocabulary"),
        ({"tokens": []}, "tokens"),
        ({"from_session": "no-such-session"}, "not known"),
    ],
)
def test_bad_create_bodies(pc: httpx.Client, body: dict[str, object], needle: str) -> None:
    r = pc.post("/polykv/pools", json=body, headers=ADMIN)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]["message"]
    assert listing(pc)["pools"] == []


def test_keys(pc: httpx.Client) -> None:
    body = {"prompt": "x"}
    r = pc.post("/polykv/pools", json=body)
    assert r.status_code == 401
    r = pc.post("/polykv/pools", json=body, headers={"Authorization": "Bearer infer-key"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    # The inference key reads status and attaches; only management needs the admin key.
    assert pc.get("/polykv/pools", headers={"Authorization": "Bearer infer-key"}).status_code == 200
    assert listing(pc)["pools"] == []


def test_release_while_a_session_decodes_does_not_corrupt_it(pc: httpx.Client) -> None:
    prefix = tokenize(pc, SYSTEM)
    prompt = prefix + tokenize(pc, " the long one", add_special=False)
    create(pc, tokens=prefix, name="rel")
    expected = unpooled(pc, prompt, 300)
    pieces: list[str] = []
    released = threading.Event()
    body = {"prompt": prompt, "n_predict": 300, "temperature": 0, "stream": True,
            "pool_id": "rel", "cache_prompt": False}  # fmt: skip
    with pc.stream("POST", "/completion", json=body, headers=ADMIN) as resp:
        for i, data in enumerate(sse_events(resp)):
            ev = json.loads(data)
            if not ev["stop"]:
                pieces.append(ev["content"])
            if i == 20 and not released.is_set():
                r = pc.delete("/polykv/pools/rel", headers=ADMIN)
                assert r.status_code == 200, r.text
                released.set()
    assert released.is_set()
    assert "".join(pieces) == expected
    lst = check_accounting(pc)
    assert lst["pools"] == []


def test_evict_and_rematerialize(pc: httpx.Client) -> None:
    create(pc, prompt=SYSTEM, name="ev")
    prompt = SYSTEM + "Question?"
    first = complete(pc, prompt, 16, pool_id="ev", cache_prompt=False).json()["content"]
    # The first attach left an idle session on the pool: evicting is refused while in use.
    r = pc.post("/polykv/pools/ev/evict", headers=ADMIN)
    assert r.status_code == 409 and "in use" in r.json()["error"]["message"]
    assert pc.post("/polykv/pools/ev/flush", headers=ADMIN).status_code == 200
    st = pc.get("/polykv/pools/ev", headers=ADMIN).json()
    assert st["residency"] == "evicted" and st["seq_id"] is None and st["own_kv_bytes"] == 0
    check_accounting(pc)
    again = complete(pc, prompt, 16, pool_id="ev", cache_prompt=False)
    assert again.json()["content"] == first
    assert again.json()["timings"]["cache_n"] > 0
    assert pc.get("/polykv/pools/ev", headers=ADMIN).json()["residency"] == "resident"
    check_accounting(pc)


def test_pin_blocks_eviction_and_reports_orphans(pc: httpx.Client) -> None:
    create(pc, prompt=SYSTEM, name="pinned", pin=True)
    st = pc.get("/polykv/pools/pinned", headers=ADMIN).json()
    assert st["pinned"] and st["pinned_explicit"] and st["orphaned_pin"]
    r = pc.post("/polykv/pools/pinned/evict", headers=ADMIN)
    assert r.status_code == 409 and "pinned" in r.json()["error"]["message"]
    st = pc.post("/polykv/pools/pinned/unpin", headers=ADMIN).json()
    assert not st["pinned"] and not st["orphaned_pin"]
    assert pc.post("/polykv/pools/pinned/evict", headers=ADMIN).json()["residency"] == "evicted"


def test_interior_pool_is_auto_pinned_while_a_child_is_resident(pc: httpx.Client) -> None:
    create(pc, prompt=SYSTEM, name="interior")
    fork(pc, "interior", prompt=SYSTEM + TOOLS_A, name="leaf")
    st = pc.get("/polykv/pools/interior", headers=ADMIN).json()
    assert (
        st["pinned"]
        and not st["pinned_explicit"]
        and [d["name"] for d in st["descendants"]] == ["leaf"]
    )
    r = pc.post("/polykv/pools/interior/evict", headers=ADMIN)
    assert r.status_code == 409 and "leaf" in r.json()["error"]["message"]


def test_pool_from_session_snapshot(pc: httpx.Client) -> None:
    prompt = tokenize(pc, SYSTEM)
    r = complete(pc, prompt, 12, session_id="snap-src")
    assert r.status_code == 200
    cells_before = check_accounting(pc)["kv_cells_used"]
    p = create(pc, from_session="snap-src", name="snap")
    # The snapshot holds what the session's KV holds: prompt + generated (last one undecoded).
    assert p["prefix_len"] == len(prompt) + 12 - 1
    lst = check_accounting(pc)
    assert lst["kv_cells_used"] == cells_before  # zero copy: the pool shares the session's cells
    assert lst["pools"][0]["own_kv_bytes"] == p["prefix_len"] * lst["kv_bytes_per_token"]
    toks = r.json()["tokens"]
    attach = complete(pc, prompt + toks + [5, 6, 7], 4, pool_id="snap", session_id="snap-user")
    assert attach.json()["timings"]["cache_n"] == p["prefix_len"]
    check_accounting(pc)


def test_dry_run_reports_without_creating(pc: httpx.Client) -> None:
    create(pc, prompt=SYSTEM, name="dry-root")
    r = pc.post(
        "/polykv/pools/dry-root/fork",
        json={"prompt": SYSTEM[:100] + TOOLS_B, "dry_run": True},
        headers=ADMIN,
    )
    body = r.json()
    assert r.status_code == 200 and body["dry_run"] is True and body["branch_pos"] > 0
    assert len(listing(pc)["pools"]) == 1


def test_chat_pool_from_messages_is_shared_by_chat_attach(pc: httpx.Client) -> None:
    system = {"role": "system", "content": SYSTEM}
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    p = create(pc, messages=[system], tools=tools, name="chat-root")
    body = {
        "messages": [system, {"role": "user", "content": "What are the rules?"}],
        "tools": tools,
        "max_tokens": 8,
        "temperature": 0,
        "pool_id": "chat-root",
    }
    r = pc.post("/v1/chat/completions", json=body, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["timings"]["cache_n"] >= p["prefix_len"] - 1
    check_accounting(pc)


def test_tools_in_any_key_order_share_the_pool(pc: httpx.Client) -> None:
    system = {"role": "system", "content": SYSTEM}
    tool = {"type": "function", "function": {"name": "search", "description": "find things",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}  # fmt: skip
    p = create(pc, messages=[system], tools=[tool], name="tools-root")
    shuffled = {"function": {"parameters": {"properties": {"q": {"type": "string"}},
                "type": "object"}, "description": "find things", "name": "search"},
                "type": "function"}  # fmt: skip
    body = {"messages": [system, {"role": "user", "content": "hi"}], "tools": [shuffled],
            "max_tokens": 4, "temperature": 0, "pool_id": "tools-root"}  # fmt: skip
    r = pc.post("/v1/chat/completions", json=body, headers=ADMIN)
    assert r.json()["timings"]["cache_n"] >= p["prefix_len"] - 1


def test_listing_carries_each_pools_capacity(pc: httpx.Client) -> None:
    create(pc, prompt=SYSTEM, name="cap-root")
    (pool,) = listing(pc)["pools"]
    cap = pool["capacity"]
    assert cap["can_admit"] is True and cap["reason"] == "ok"
    assert cap["headroom_sessions"] >= 1 and 0.0 <= cap["compaction_pressure"] <= 1.0


def test_listing_revalidates_by_etag(pc: httpx.Client) -> None:
    create(pc, prompt=SYSTEM, name="tagged")
    first = pc.get("/polykv/pools", headers=ADMIN)
    etag = first.headers["ETag"]
    assert first.status_code == 200 and etag.startswith('"') and first.json()["pools"]
    for sent in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        r = pc.get("/polykv/pools", headers={**ADMIN, "If-None-Match": sent})
        assert r.status_code == 304 and r.content == b"" and r.headers["ETag"] == etag, sent
    assert pc.get("/polykv/pools", headers={**ADMIN, "If-None-Match": '"stale"'}).status_code == 200
    fork(pc, "tagged", prompt=SYSTEM + TOOLS_A, name="tagged-child")
    r = pc.get("/polykv/pools", headers={**ADMIN, "If-None-Match": etag})
    assert r.status_code == 200 and r.headers["ETag"] != etag  # changed: the whole listing
    assert {p["name"] for p in r.json()["pools"]} >= {"tagged", "tagged-child"}


def test_flush_and_slot_erase_refusals(pc: httpx.Client) -> None:
    create(pc, prompt=SYSTEM, name="fl-root")
    fork(pc, "fl-root", prompt=SYSTEM + TOOLS_A, name="fl-kid", pin=True)
    r = pc.post("/polykv/pools/fl-root/flush", headers=ADMIN)
    assert r.status_code == 409 and "fl-kid" in r.json()["error"]["message"]
    assert {p["residency"] for p in listing(pc)["pools"]} == {"resident"}
    assert pc.delete("/polykv/pools/ghost/admission", headers=ADMIN).status_code == 404
    for path, status in (
        ("/slots/abc?action=erase", 400),
        ("/slots/0?action=explode", 400),
        ("/slots/0?action=save", 501),
        ("/slots/99?action=erase", 404),
    ):
        r = pc.post(path, headers=ADMIN)
        assert r.status_code == status, (path, r.text)
        assert r.json()["error"]["code"] == status
    r = pc.post("/slots/0?action=erase", headers={"Authorization": "Bearer infer-key"})
    assert r.status_code == 403


def test_session_lookup_says_where_a_session_lives(client: httpx.Client) -> None:
    r = client.post("/completion", json=greedy("where am I", 2, session_id="lookup-1"))
    assert r.status_code == 200
    info = client.get("/polykv/sessions/lookup-1")
    assert info.status_code == 200
    body = info.json()
    assert body["session_id"] == "lookup-1" and body["slot"] == r.json()["id_slot"]
    assert body["boot_id"] == client.get("/props").json()["polykv"]["boot_id"]
    assert body["ctx_used"] > 0 and body["state"] == "idle"
    missing = client.get("/polykv/sessions/nobody-here")
    assert missing.status_code == 404 and missing.json()["error"]["reason"] == "session_not_found"


def test_one_pools_answers_match_the_whole_listing(pc: httpx.Client) -> None:
    # A pin, a GET or a create builds only the statuses it returns; ownership must still be
    # attributed over every pool (a fork's cells below its branch point belong to its parent,
    # outside a GET of the fork's subtree), so every figure must be what the listing says.
    create(pc, prompt=SYSTEM, name="other")
    r = complete(pc, SYSTEM + "Question one?", 8, pool_id="other", session_id="s-other")
    assert r.status_code == 200, r.text
    create(pc, prompt=SYSTEM + TOOLS_B, name="top")
    fork(pc, "top", prompt=SYSTEM + TOOLS_B + TOOLS_A, name="a")
    fork(pc, "a", prompt=SYSTEM + TOOLS_B + TOOLS_A + "Plan first. ", name="a1")
    fork(pc, "top", prompt=SYSTEM + TOOLS_B + "Review. ", name="b")
    # A root pool snapshotted from a session on a1 holds cells of top, a and a1: pools share
    # cells across roots, and each cell still belongs to the oldest pool holding it.
    r = complete(
        pc, SYSTEM + TOOLS_B + TOOLS_A + "Plan first. Go.", 6, pool_id="a1", session_id="s-a1"
    )
    assert r.status_code == 200, r.text
    create(pc, from_session="s-a1", name="snap-a1")
    whole = check_accounting(pc)
    by_name = {p["name"]: p for p in whole["pools"]}
    bpt = whole["kv_bytes_per_token"]
    assert by_name["a"]["own_kv_bytes"] < by_name["a"]["prefix_len"] * bpt
    (session,) = by_name["a1"]["sessions"]
    # The snapshot owns exactly the session's cells no older pool holds
    assert by_name["snap-a1"]["own_kv_bytes"] == (
        (by_name["snap-a1"]["prefix_len"] - session["shared_prefix_tokens"]) * bpt
    )
    for name in ("other", "top", "a", "a1", "b", "snap-a1"):
        detail = pc.get(f"/polykv/pools/{name}", headers=ADMIN).json()
        descendants = detail.pop("descendants")
        detail.pop("boot_id")
        assert detail == by_name[name]
        below = [p for p in whole["pools"] if name in p["path"].split("/")[:-1]]
        assert descendants == below
    pinned = pc.post("/polykv/pools/a/pin", headers=ADMIN).json()
    assert pinned == {**by_name["a"], "pinned": True, "pinned_explicit": True}
