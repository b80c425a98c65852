"""Pools on models whose memory is not plain attention, through HTTP, on generated models:

- sliding window (Gemma 3's architecture, a 32-token window): pools are held whole by guard
  sequences in a full-size SWA cache. Pooled output equals unpooled for root, extend and
  branch, before and after the cache has cycled many times past the window around the pool;
  a snapshot of a session whose window was recycled is computed again, not shared with holes.
- recurrent (Mamba) and hybrid (Jamba): a session attaches at exactly the pool's length and
  computes what a full prefill computes; every attach or fork below that length is refused
  with its reason; a recurrent state is counted per sequence in the KV figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess

from .conftest import DETERMINISTIC
from .pool_helpers import ADMIN, check_accounting, complete, create, fork, listing, release_all

WINDOW = 32  # the test-swa model's
KEYS = ["--api-key", "infer-key", "--polykv-admin-key", "admin-key"]


def client_of(eng: EngineProcess) -> httpx.Client:
    return httpx.Client(base_url=eng.base_url, timeout=180, headers=ADMIN)


def tokens_of(c: httpx.Client, text: str, add_special: bool = True) -> list[int]:
    out: list[int] = c.post("/tokenize", json={"content": text, "add_special": add_special}).json()[
        "tokens"
    ]
    return out


def words(c: httpx.Client, n: int, seed: int) -> list[int]:
    vocab = "river light garden window train quiet market winter letter music road table".split()  # noqa: SIM905
    text = " ".join(vocab[(seed * 7 + i * (seed + 3)) % len(vocab)] for i in range(2 * n))
    return tokens_of(c, text, add_special=False)[:n]


def greedy(c: httpx.Client, prompt: list[int], n: int = 16, **extra: Any) -> dict[str, Any]:
    r = complete(c, prompt, n, **extra)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def unpooled(c: httpx.Client, prompt: list[int], n: int = 16) -> list[int]:
    toks: list[int] = greedy(c, prompt, n, cache_prompt=False)["tokens"]
    return toks


# ---------------------------------------------------------------------------- sliding window


@pytest.fixture(scope="module")
def swa_engine(start_on: Callable[..., EngineProcess], swa_model: Path) -> EngineProcess:
    return start_on(
        swa_model, "-np", "3", "-c", "4096", "--polykv-max-pools", "4", "--polykv-kv-debug",
        *KEYS, *DETERMINISTIC,
    )  # fmt: skip


@pytest.fixture
def sc(swa_engine: EngineProcess) -> Iterator[httpx.Client]:
    with client_of(swa_engine) as c:
        release_all(c)
        for slot in c.get("/slots").json():
            assert c.post(f"/slots/{slot['id']}?action=erase").status_code == 200
        yield c
        release_all(c)


def churn(c: httpx.Client, rounds: int) -> None:
    """Sessions come and go on the other slots, each many windows long: the SWA cache's
    cells are handed out again and again around the pools."""
    for k in range(rounds):
        body = {"n_predict": 6 * WINDOW, "ignore_eos": True, "session_id": f"churn-{k % 2}"}
        greedy(c, words(c, 3 * WINDOW, seed=100 + k), **body)


def test_swa_pools_equal_unpooled_and_stay_whole_as_the_cache_cycles(
    sc: httpx.Client, swa_engine: EngineProcess
) -> None:
    memory = sc.get("/props").json()["polykv"]["memory"]
    assert memory["kind"] == "sliding_window" and memory["sliding_window"] == WINDOW
    assert memory["swa_full"] and memory["swa_full_extra_bytes"] > 0
    assert "guard sequence" in memory["pools"]
    assert "full-size cache" in swa_engine.log_tail(400)

    # A session holds the cache's first cells while the pools are built, and then goes:
    # the next sessions' tokens sweep from there over the pools' cells, again and again.
    below = greedy(sc, words(sc, 4 * WINDOW, seed=99), WINDOW, ignore_eos=True)
    system = words(sc, 6 * WINDOW, seed=1)  # six windows long
    tools = words(sc, WINDOW, seed=2)
    root = create(sc, tokens=system, name="root")["pool"]
    ext = fork(sc, "root", tokens=system + tools, name="ext")["pool"]
    branch_at = 4 * WINDOW + 5  # inside the root, past several windows
    br = fork(sc, "root", tokens=system[:branch_at] + tools, name="br")["pool"]
    assert (ext["branch_pos"], br["branch_pos"]) == (root["prefix_len"], branch_at)

    asks = {
        "root": system + words(sc, 9, seed=3),
        "ext": system + tools + words(sc, 9, seed=4),
        "br": system[:branch_at] + tools + words(sc, 9, seed=5),
        # attached inside the root: auto-P stops where the prompt leaves the pool
        "root-inside": system[: 3 * WINDOW] + words(sc, 9, seed=6),
    }
    expected = {name: unpooled(sc, prompt) for name, prompt in asks.items()}

    def attach_all() -> None:
        for name, prompt in asks.items():
            pool = name.split("-")[0]
            got = greedy(sc, prompt, pool_id=pool, cache_prompt=False)
            assert got["tokens"] == expected[name], name
            shared = 3 * WINDOW if name == "root-inside" else len(prompt) - 9
            assert got["timings"]["cache_n"] == shared, name
        check_accounting(sc)

    attach_all()
    assert sc.post(f"/slots/{below['id_slot']}?action=erase").status_code == 200
    churn(sc, rounds=6)
    attach_all()  # the pools' cells were never handed out: still equal
    for name in ("br", "ext", "root"):  # a release frees the pool's cells and its guard's
        assert sc.delete(f"/polykv/pools/{name}").status_code == 200
        check_accounting(sc)
    for slot in sc.get("/slots").json():
        assert sc.post(f"/slots/{slot['id']}?action=erase").status_code == 200
    assert listing(sc)["kv_cells_measured"] == 0


def test_swa_snapshot_of_a_session_whose_window_was_recycled_is_computed_again(
    sc: httpx.Client,
) -> None:
    # The session ran far past its window: its first cells went to other tokens. A pool
    # made from it takes its tokens, not its cells, and serves them whole.
    prompt = words(sc, 2 * WINDOW, seed=7)
    session = greedy(sc, prompt, 8 * WINDOW, ignore_eos=True, session_id="long")
    context = prompt + session["tokens"][:-1]
    churn(sc, rounds=2)
    snap = create(sc, from_session="long", name="snap")["pool"]
    assert snap["prefix_len"] == len(context)
    ask = context + words(sc, 9, seed=8)
    got = greedy(sc, ask, pool_id="snap", cache_prompt=False)
    assert got["tokens"] == unpooled(sc, ask)
    assert got["timings"]["cache_n"] == len(context)
    check_accounting(sc)


def erase_slots(c: httpx.Client) -> None:
    for slot in c.get("/slots").json():
        assert c.post(f"/slots/{slot['id']}?action=erase").status_code == 200


def test_swa_sessions_share_a_long_prompt_automatically(sc: httpx.Client) -> None:
    # No pool: a second session with the first one's prompt (an agent CLI's system prompt
    # and tools, many windows long) takes its cells, and computes what it would alone.
    system = words(sc, 6 * WINDOW, seed=50)
    asks = [system + words(sc, 9, seed=51 + i) for i in range(2)]
    expected = [unpooled(sc, a) for a in asks]
    erase_slots(sc)
    first = greedy(sc, asks[0], session_id="a")
    second = greedy(sc, asks[1], session_id="b")
    assert [first["tokens"], second["tokens"]] == expected
    assert first["timings"]["cache_n"] == 0
    assert second["timings"]["cache_n"] >= len(system)
    lst = check_accounting(sc)
    assert lst["implicit_shared_cells"] >= len(system)


def test_swa_sessions_share_nothing_in_a_window_sized_cache(
    start_on: Callable[..., EngineProcess], swa_model: Path
) -> None:
    # No pools and no --swa-full: the window layers get a window-sized cache, which cells
    # two sequences hold (never handed out) could fill. Each session computes its prompt.
    eng = start_on(swa_model, "-np", "2", "-c", "1024", "--polykv-max-pools", "0", *DETERMINISTIC)
    with client_of(eng) as c:
        assert not c.get("/props").json()["polykv"]["memory"]["swa_full"]
        system = words(c, 6 * WINDOW, seed=50)
        for i, session in enumerate(("a", "b")):
            got = greedy(c, system + words(c, 9, seed=51 + i), session_id=session)
            assert got["timings"]["cache_n"] == 0


def test_swa_automatic_sharing_takes_only_what_the_window_still_holds(sc: httpx.Client) -> None:
    # A session runs far past its window above another one's cells; that one goes, and the
    # next sessions' tokens sweep from there over the first one's cells: its earliest ones
    # are handed out. A prompt that leaves its context early needs the window before that
    # point, which is gone: computed again, equal to a fresh run. One that goes on past its
    # end needs only its last window: shared.
    erase_slots(sc)
    below = greedy(sc, words(sc, 4 * WINDOW, seed=59), WINDOW, ignore_eos=True)
    prompt = words(sc, 2 * WINDOW, seed=60)
    long = greedy(sc, prompt, 8 * WINDOW, ignore_eos=True, session_id="long")
    context = prompt + long["tokens"][:-1]
    assert sc.post(f"/slots/{below['id_slot']}?action=erase").status_code == 200
    for k in range(2):  # on the free slots: no session id
        greedy(sc, words(sc, 3 * WINDOW, seed=70 + k), 6 * WINDOW, ignore_eos=True)
    early = context[: 3 * WINDOW] + words(sc, 9, seed=61)
    late = context + words(sc, 9, seed=62)
    want = {}
    for name, ask in (("early", early), ("late", late)):
        fresh = greedy(sc, ask, cache_prompt=False)
        want[name] = fresh["tokens"]
        # Its cache would be shared in full: only what is left of "long" may be.
        assert sc.post(f"/slots/{fresh['id_slot']}?action=erase").status_code == 200
    got = greedy(sc, early, session_id="early")
    assert got["tokens"] == want["early"]
    assert got["timings"]["cache_n"] == 0
    got = greedy(sc, late, session_id="late")
    assert got["tokens"] == want["late"]
    assert got["timings"]["cache_n"] == len(context)
    check_accounting(sc)


def test_swa_pool_with_flash_attention_matches_within_its_tolerance(
    start_on: Callable[..., EngineProcess], swa_model: Path
) -> None:
    # ggml's CPU flash attention reduces in an order that depends on the batch's shape:
    # logprobs of a pooled and an unpooled run agree to rounding, not bit for bit.
    eng = start_on(swa_model, "-np", "2", "-c", "2048", *KEYS, "-fa", "on")
    with client_of(eng) as c:
        system = words(c, 5 * WINDOW, seed=9)
        create(c, tokens=system, name="fa")
        prompt = system + words(c, 9, seed=10)
        pooled = greedy(c, prompt, 8, pool_id="fa", cache_prompt=False, n_probs=1)
        fresh = greedy(c, prompt, 8, cache_prompt=False, n_probs=1)
        a = pooled["completion_probabilities"][0]
        b = fresh["completion_probabilities"][0]
        assert a["id"] == b["id"]
        assert abs(a["logprob"] - b["logprob"]) < 1e-2


# ---------------------------------------------------------------------------- recurrent


@pytest.fixture(scope="module", params=["mamba", "jamba"])
def recurrent(
    request: pytest.FixtureRequest,
    start_on: Callable[..., EngineProcess],
    mamba_model: Path,
    jamba_model: Path,
) -> tuple[str, EngineProcess]:
    model = mamba_model if request.param == "mamba" else jamba_model
    eng = start_on(model, "-np", "3", "-c", "4096", "--polykv-max-pools", "4", *KEYS,
                   *DETERMINISTIC)  # fmt: skip
    return request.param, eng


@pytest.fixture
def rc(recurrent: tuple[str, EngineProcess]) -> Iterator[httpx.Client]:
    with client_of(recurrent[1]) as c:
        release_all(c)
        yield c
        release_all(c)


def refusal(r: httpx.Response) -> str:
    assert 400 <= r.status_code < 500, r.text
    reason: str = r.json()["error"]["reason"]
    return reason


def test_recurrent_pools_attach_at_exactly_the_prefix_and_refuse_anything_shorter(
    rc: httpx.Client, recurrent: tuple[str, EngineProcess]
) -> None:
    kind = recurrent[0]
    memory = rc.get("/props").json()["polykv"]["memory"]
    assert memory["kind"] == ("recurrent" if kind == "mamba" else "hybrid")
    assert memory["recurrent_state_bytes"] > 0 and "exactly" in memory["pools"]

    system = words(rc, 120, seed=11)
    create(rc, tokens=system, name="sys")
    for n in (5, 17):  # two sessions, each from the pool's state at exactly L
        ask = system + words(rc, n, seed=12 + n)
        got = greedy(rc, ask, pool_id="sys", cache_prompt=False)
        assert got["tokens"] == unpooled(rc, ask)
        assert got["timings"]["cache_n"] == len(system)

    below = [
        {"prompt": system},  # the prefix alone: its last token would be cut off
        {"prompt": system[:90] + words(rc, 6, seed=20)},  # auto-P short of L
        {"prompt": system + [7, 8], "shared_prefix_n_tokens": 60},  # a declared P below L
    ]
    for body in below:
        r = rc.post("/completion", json={**body, "n_predict": 4, "pool_id": "sys"})
        assert refusal(r) == "recurrent_attach"
        assert "exists only at" in r.json()["error"]["message"] or "only at its end" in r.text

    r = rc.post("/polykv/pools/sys/fork", json={"tokens": system[:60] + [5, 6], "name": "br"})
    assert refusal(r) == "recurrent_branch"
    r = rc.post(
        "/polykv/pools/sys/fork",
        json={"tokens": system + [5, 6], "branch_pos": 100, "name": "br"},
    )
    assert refusal(r) == "recurrent_branch"
    tools = words(rc, 30, seed=21)
    ext = fork(rc, "sys", tokens=system + tools, name="ext")["pool"]
    assert ext["branch_pos"] == len(system)
    ask = system + tools + words(rc, 7, seed=22)
    got = greedy(rc, ask, pool_id="ext", cache_prompt=False)
    assert got["tokens"] == unpooled(rc, ask)
    assert got["timings"]["cache_n"] == len(system) + len(tools)


def test_recurrent_sessions_reuse_a_cache_whole_or_start_over(rc: httpx.Client) -> None:
    # A turn that goes on from the last one continues its state; one that leaves it
    # (an edited history) is computed from the start: both equal a fresh run.
    first = words(rc, 70, seed=30)
    one = greedy(rc, first, 8, session_id="s")
    follow = first + one["tokens"] + words(rc, 5, seed=31)
    two = greedy(rc, follow, 8, session_id="s")
    assert two["tokens"] == unpooled(rc, follow, 8)
    assert two["timings"]["cache_n"] == len(first) + len(one["tokens"]) - 1
    edited = first[:40] + words(rc, 6, seed=32)
    three = greedy(rc, edited, 8, session_id="s")
    assert three["tokens"] == unpooled(rc, edited, 8)
    assert three["timings"]["cache_n"] == 0


def test_a_recurrent_state_is_counted_per_sequence(rc: httpx.Client) -> None:
    release_all(rc)
    for slot in rc.get("/slots").json():
        assert rc.post(f"/slots/{slot['id']}?action=erase").status_code == 200
    system = words(rc, 50, seed=40)
    create(rc, tokens=system, name="sys")
    greedy(rc, system + words(rc, 6, seed=41), pool_id="sys", session_id="a")
    lst = listing(rc)
    state, bpt = lst["recurrent_state_bytes"], lst["kv_bytes_per_token"]
    assert state > 0
    pool = lst["pools"][0]
    assert pool["own_kv_bytes"] == len(system) * bpt + state
    session = pool["sessions"][0]
    assert session["marginal_kv_bytes"] == session["suffix_n_tokens"] * bpt + state
    assert lst["kv_bytes_used"] == lst["kv_cells_used"] * bpt + 2 * state
    assert pool["own_kv_bytes"] + session["marginal_kv_bytes"] == lst["kv_bytes_used"]
