"""Pools that survive a restart: KV snapshots written once a pool is built, restored by the
next engine instead of prefilled, or fetched from a peer replica.

Real engines on the generated model (f32 KV, -fa off), stopped and started again on the same
snapshot directory: a restored tree answers bit for bit as the prefilled one did (tokens and
their probabilities), a child's restore shares its parent's cells (llama.cpp's own used-cell
count agrees), and every kind of bad snapshot (reliability scenario 21) costs a prefill, a
reason and a counter, never a crash, a wrong answer or a partial pool.
"""

from __future__ import annotations

import json
import resource
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess, free_port

from .conftest import DETERMINISTIC
from .pool_helpers import ADMIN, check_accounting, listing

ROOT_LEN, KID_LEN, BRANCH_AT, TWIG_LEN = 200, 300, 120, 180
TOKENS = [(i * 7919) % 900 + 5 for i in range(KID_LEN)]
TWIG = TOKENS[:BRANCH_AT] + [(i * 104729) % 900 + 5 for i in range(TWIG_LEN - BRANCH_AT)]
POOLS = {  # name: (parent, tokens)
    "root": (None, TOKENS[:ROOT_LEN]),
    "kid": ("root", TOKENS),  # extends root
    "twig": ("root", TWIG),  # branches off root at 120
}


def boot(
    start: Callable[..., EngineProcess], store: Path, *extra: str, admin: str = "admin-key"
) -> EngineProcess:
    return start(
        "-np", "2", "-c", "4096", "--polykv-kv-debug", "--metrics",
        "--polykv-admin-key", admin, "--polykv-snapshot-dir", str(store),
        *DETERMINISTIC, *extra,
    )  # fmt: skip


def client(eng: EngineProcess) -> httpx.Client:
    return httpx.Client(base_url=eng.base_url, timeout=120)


def create(c: httpx.Client, name: str, expect: int = 201, **extra: Any) -> dict[str, Any]:
    parent, tokens = POOLS[name]
    url = "/polykv/pools" if parent is None else f"/polykv/pools/{parent}/fork"
    r = c.post(url, json={"name": name, "tokens": tokens, **extra}, headers=ADMIN)
    assert r.status_code == expect, r.text
    out: dict[str, Any] = r.json()
    return out


def build_tree(c: httpx.Client, **extra: Any) -> dict[str, dict[str, Any]]:
    """Every pool, parents first; each one's ``restore`` report."""
    return {name: create(c, name, **extra)["restore"] for name in POOLS}


def answers(c: httpx.Client) -> list[Any]:
    """A session on each pool, attached inside the pool and past its end: greedy tokens with
    their probabilities (exact floats: a restored cell that differs by one bit shows)."""
    out = []
    for name, (_, tokens) in POOLS.items():
        for p in (len(tokens) - 40, len(tokens)):
            body = {
                "prompt": tokens[:p] + [7, 8, 9],
                "pool_id": name,
                "n_predict": 12,
                "temperature": 0,
                "n_probs": 3,
            }
            r = c.post("/completion", json=body, headers=ADMIN)
            assert r.status_code == 200, r.text
            done = r.json()
            out.append((done["tokens"], done["completion_probabilities"]))
    for slot in c.get("/slots", headers=ADMIN).json():  # sessions' cells go: pools' alone stay
        assert c.post(f"/slots/{slot['id']}?action=erase", headers=ADMIN).status_code == 200
    return out


def metric(c: httpx.Client, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_files(c: httpx.Client, n: int) -> None:
    """The store's writer thread has written ``n`` snapshots (a condition, not a sleep)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if listing(c)["snapshots"]["files"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{listing(c)['snapshots']} after 60 s, expected {n} files")


def snapshot_file(store: Path, length: int) -> Path:
    """The stored snapshot of the pool whose prefix is ``length`` tokens long."""
    for path in store.glob("*.pkv"):
        data = path.read_bytes()
        (n,) = struct.unpack("<I", data[8:12])
        if json.loads(data[12 : 12 + n])["key"]["length"] == length:
            return path
    raise AssertionError(f"no snapshot of a {length}-token pool in {store}")


@pytest.fixture(scope="module")
def seeded(
    start_engine: Callable[..., EngineProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, list[Any], dict[str, int]]]:
    """A store holding the tree's snapshots, the answers of the engine that prefilled it, and
    each pool's own KV bytes there."""
    store = tmp_path_factory.mktemp("seeded-store")
    eng = boot(start_engine, store)
    with client(eng) as c:
        reports = build_tree(c)
        assert {r["source"] for r in reports.values()} == {"prefill"}
        wait_files(c, len(POOLS))
        own = {p["name"]: p["own_kv_bytes"] for p in listing(c)["pools"]}
        got = answers(c)
    eng.stop()
    yield store, got, own


def copy_of(store: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(store, tmp_path / "store"))


def test_a_restarted_engine_restores_its_pools_bit_identical(
    start_engine: Callable[..., EngineProcess],
    seeded: tuple[Path, list[Any], dict[str, int]],
    tmp_path: Path,
) -> None:
    store, before, own_before = seeded
    eng = boot(start_engine, copy_of(store, tmp_path))
    with client(eng) as c:
        reports = build_tree(c)
        for name, report in reports.items():
            assert report["source"] == "store" and report["refused"] is None, (name, report)
            assert report["snapshot_bytes"] > 0
        lst = check_accounting(c)  # llama.cpp's used cells == the shadow model's
        assert {p["name"]: p["materialized_from"] for p in lst["pools"]} == dict.fromkeys(
            POOLS, "store"
        )
        # A child holds its own range only: the parent's cells are shared, not duplicated.
        assert {p["name"]: p["own_kv_bytes"] for p in lst["pools"]} == own_before
        assert lst["kv_cells_used"] == ROOT_LEN + (KID_LEN - ROOT_LEN) + (TWIG_LEN - BRANCH_AT)
        assert answers(c) == before
        assert metric(c, 'polykv_pool_restore_seconds_count{source="store"}') == len(POOLS)
        assert metric(c, 'polykv_snapshot_bytes_read_total{source="store"}') > 0
        assert metric(c, "polykv_snapshot_bytes_written_total") == 0  # nothing to write again
        again = create(c, "root", expect=200)  # an existing pool: no lookup, no restore report
        assert again["created"] is False and again["restore"] is None


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1000])


def _other_model(path: Path) -> None:
    """The header of a file another model's engine wrote (its payload checks out)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<I", data[8:12])
    head = json.loads(data[12 : 12 + n])
    head["key"]["fingerprint"]["model"] = "0" * 64
    text = json.dumps(head).encode()
    path.write_bytes(data[:8] + struct.pack("<I", len(text)) + text + data[12 + n :])


def _too_large(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * (4 << 20))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_corrupt, "corrupt"),
        (_truncate, "truncated"),
        (_other_model, "other_model"),
        (_too_large, "too_large"),
    ],
)
def test_a_bad_snapshot_is_refused_with_its_reason_and_the_pool_prefilled(
    start_engine: Callable[..., EngineProcess],
    seeded: tuple[Path, list[Any], dict[str, int]],
    tmp_path: Path,
    damage: Callable[[Path], None],
    reason: str,
) -> None:
    store, before, _ = seeded
    mine = copy_of(store, tmp_path)
    bad = snapshot_file(mine, ROOT_LEN)
    damage(bad)
    eng = boot(start_engine, mine)
    with client(eng) as c:
        reports = build_tree(c)
        assert reports["root"]["source"] == "prefill"
        assert reports["root"]["refused"] == reason, reports["root"]
        # The other pools are untouched: they restore on top of the prefilled root.
        assert reports["kid"]["source"] == reports["twig"]["source"] == "store"
        check_accounting(c)  # nothing partial stayed in the cache
        assert answers(c) == before
        assert metric(c, f'polykv_snapshot_refusals_total{{reason="{reason}"}}') == 1
        wait_files(c, len(POOLS))  # the refused file went; the prefilled root is saved anew
        assert c.get("/health").status_code == 200
    assert eng.stop() == 0
    good = snapshot_file(store, ROOT_LEN).stat().st_size
    assert snapshot_file(mine, ROOT_LEN).stat().st_size == good  # whole again


def test_a_full_disk_skips_the_snapshot_and_serving_goes_on(
    start_engine: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    eng = boot(start_engine, store)
    assert eng.proc is not None and eng.log_path is not None
    # The kernel refuses any write that would grow a file of the engine past this size: the
    # root's snapshot (~100 KB) does not fit, the log still has room.
    limit = eng.log_path.stat().st_size + (64 << 10)
    resource.prlimit(eng.proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
    with client(eng) as c:
        report = create(c, "root")["restore"]
        assert report["source"] == "prefill"
        deadline = time.monotonic() + 60
        while metric(c, 'polykv_snapshot_writes_skipped_total{reason="disk_full"}') < 1:
            assert time.monotonic() < deadline, "the failed write was never counted"
            time.sleep(0.05)
        assert listing(c)["snapshots"]["files"] == 0
        assert not list(store.iterdir())  # the half-written file is gone
        body = {"prompt": TOKENS[:ROOT_LEN] + [7], "pool_id": "root", "n_predict": 4}
        assert c.post("/completion", json=body, headers=ADMIN).status_code == 200
    assert eng.stop() == 0


def test_a_new_replica_restores_from_a_peer_and_keeps_the_snapshot(
    start_engine: Callable[..., EngineProcess],
    seeded: tuple[Path, list[Any], dict[str, int]],
    tmp_path: Path,
) -> None:
    store, before, _ = seeded
    peer = boot(start_engine, copy_of(store, tmp_path))
    fresh = tmp_path / "fresh"
    eng = boot(start_engine, fresh)
    with client(eng) as c:
        reports = build_tree(c, restore_peer=peer.base_url)
        assert {r["source"] for r in reports.values()} == {"peer"}, reports
        check_accounting(c)
        assert answers(c) == before
        assert metric(c, 'polykv_pool_restore_seconds_count{source="peer"}') == len(POOLS)
        assert metric(c, 'polykv_snapshot_bytes_read_total{source="peer"}') > 0
        assert len(list(fresh.glob("*.pkv"))) == len(POOLS)  # this replica can serve them now
    assert "MiB from http://" in (eng.log_tail(200))  # the transfer's progress line
    eng.stop()
    again = boot(start_engine, fresh)  # ... and restore them itself after a restart
    with client(again) as c:
        assert {r["source"] for r in build_tree(c).values()} == {"store"}
    peer.stop()


def test_peer_failures_cost_a_prefill_and_a_reason(
    start_engine: Callable[..., EngineProcess],
    seeded: tuple[Path, list[Any], dict[str, int]],
    tmp_path: Path,
) -> None:
    store, before, _ = seeded
    peer_store = copy_of(store, tmp_path)
    _corrupt(snapshot_file(peer_store, KID_LEN))
    peer = boot(start_engine, peer_store)
    locked = boot(start_engine, tmp_path / "locked", admin="another-key")
    eng = boot(start_engine, tmp_path / "fresh")
    with client(eng) as c:
        nobody = f"http://127.0.0.1:{free_port()}"
        root = create(c, "root", restore_peer=nobody)["restore"]
        assert (root["source"], root["refused"]) == ("prefill", "peer_failed")
        kid = create(c, "kid", restore_peer=peer.base_url)["restore"]  # damaged on the peer
        assert (kid["source"], kid["refused"]) == ("prefill", "corrupt")
        twig = create(c, "twig", restore_peer=locked.base_url)["restore"]  # a 401 from it
        assert (twig["source"], twig["refused"]) == ("prefill", "peer_failed")
        assert "401" in twig["message"]
        assert answers(c) == before
        assert metric(c, 'polykv_snapshot_refusals_total{reason="peer_failed"}') == 2
        assert not list((tmp_path / "fresh").glob(".incoming-*"))
        # A peer that has no snapshot of the prefix: a plain prefill, nothing refused.
        body = {"name": "alone", "tokens": TOKENS[5:60], "restore_peer": peer.base_url}
        r = c.post("/polykv/pools", json=body, headers=ADMIN)
        assert r.status_code == 201, r.text
        assert (r.json()["restore"]["source"], r.json()["restore"]["refused"]) == ("prefill", None)
    for e in (peer, locked, eng):
        e.stop()


def test_snapshots_are_served_to_admins_only(
    start_engine: Callable[..., EngineProcess], engine: EngineProcess, tmp_path: Path
) -> None:
    eng = boot(start_engine, tmp_path / "store", "--api-key", "user-key")
    digest = "0" * 64
    with client(eng) as c:
        url = f"/polykv/snapshots/{digest}"
        assert c.get(url).status_code == 401
        assert c.get(url, headers={"Authorization": "Bearer user-key"}).status_code == 403
        missing = c.get(url, headers=ADMIN)
        assert missing.status_code == 404
        assert missing.json()["error"]["reason"] == "snapshot_not_found"
        bad = c.get("/polykv/snapshots/..%2F..%2Fetc%2Fpasswd", headers=ADMIN)
        assert bad.status_code in (400, 404)
        assert c.get(f"/polykv/snapshots/{'A' * 64}", headers=ADMIN).status_code == 400
    off = httpx.get(f"{engine.base_url}/polykv/snapshots/{digest}", timeout=30)
    assert off.status_code == 404 and off.json()["error"]["reason"] == "snapshots_disabled"


@pytest.mark.parametrize(
    "peer",
    ["http://peer/path", "ftp://peer:1", "http://user@peer:1", "http://peer:1?x=1", "x" * 300],
)
def test_a_bad_restore_peer_is_refused_naming_the_field(engine: EngineProcess, peer: str) -> None:
    r = httpx.post(
        f"{engine.base_url}/polykv/pools",
        json={"tokens": [1, 2, 3], "restore_peer": peer},
        timeout=30,
    )
    assert r.status_code == 400 and "restore_peer" in r.text


# ------------------------------------------------------------ other memory kinds

SWA_TWIG = TOKENS[:70] + TWIG[BRANCH_AT:]  # branches 2 windows below the root's end


def kind_tree(kind: str) -> list[tuple[str, str | None, list[int], list[list[int]]]]:
    """(name, parent, tokens, prompts) for each pool: a sliding-window branch and attaches
    well below the window's reach of the end; recurrent pools extend and attach at the end."""
    if kind == "swa":
        return [
            ("root", None, TOKENS[:ROOT_LEN], [TOKENS[:60] + [7], TOKENS[:ROOT_LEN] + [7]]),
            ("twig", "root", SWA_TWIG, [SWA_TWIG[:100] + [7], SWA_TWIG + [7]]),
        ]
    return [
        ("root", None, TOKENS[:ROOT_LEN], [TOKENS[:ROOT_LEN] + [7, 8]]),
        ("kid", "root", TOKENS, [TOKENS + [7, 8]]),
    ]


def kind_run(eng: EngineProcess, kind: str) -> tuple[list[str], list[Any]]:
    sources, out = [], []
    with client(eng) as c:
        for name, parent, tokens, _ in kind_tree(kind):
            url = "/polykv/pools" if parent is None else f"/polykv/pools/{parent}/fork"
            r = c.post(url, json={"name": name, "tokens": tokens}, headers=ADMIN)
            assert r.status_code == 201, r.text
            sources.append(r.json()["restore"]["source"])
        for name, _, _, prompts in kind_tree(kind):
            for prompt in prompts:
                body = {"prompt": prompt, "pool_id": name, "n_predict": 12, "temperature": 0}
                r = c.post("/completion", json={**body, "n_probs": 3}, headers=ADMIN)
                assert r.status_code == 200, r.text
                out.append((r.json()["tokens"], r.json()["completion_probabilities"]))
        wait_files(c, len(kind_tree(kind)))
    return sources, out


@pytest.mark.parametrize("kind", ["swa", "mamba", "jamba"])
def test_sliding_window_and_recurrent_pools_restore_bit_identical(
    start_on: Callable[..., EngineProcess],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    """A sliding-window pool is saved a window at a time (llama.cpp's writer would leave out
    the cells its last token no longer sees, which an attach or a branch lower down needs);
    a recurrent one saves its state at the end with its attention cells."""
    model = request.getfixturevalue(f"{kind}_model")
    args = ("-np", "2", "-c", "2048", "--polykv-admin-key", "admin-key",
            "--polykv-snapshot-dir", str(tmp_path / "store"), *DETERMINISTIC)  # fmt: skip
    first = start_on(model, *args)
    sources, before = kind_run(first, kind)
    assert set(sources) == {"prefill"}
    first.stop()
    again = start_on(model, *args)
    sources, after = kind_run(again, kind)
    assert set(sources) == {"store"}
    assert after == before
