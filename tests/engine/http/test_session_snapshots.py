"""Sessions across a rollout: caches written on SIGTERM, restored at the session's next turn.

Real engines on the generated model (f32 KV, -fa off), stopped by a real SIGTERM and started
again on the same snapshot directory: a session's next turn reuses its saved context (its
pool's cells shared, not duplicated) and answers as a cold prefill of the same prompt does;
a damaged or misplaced file, or another tenant, costs a prefill, a reason and a log line;
the byte budget and the deadline bound what is written.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess

from .conftest import DETERMINISTIC
from .pool_helpers import ADMIN, check_accounting
from .test_snapshots import POOLS, ROOT_LEN, boot, client, copy_of, create, metric

ALPHA = {"Authorization": "Bearer key-a"}
BETA = {"Authorization": "Bearer key-b"}
ROOT = POOLS["root"][1]
FIRST = {  # session: (its first prompt, attached to the pool "root")
    "pooled": (ROOT + [(i * 613) % 900 + 5 for i in range(60)], True),
    "alone": ([(i * 389) % 900 + 5 for i in range(150)], False),
}
NEXT = [11, 12, 13, 14, 15]  # what each session's next turn adds


def turn(
    c: httpx.Client, headers: dict[str, str], prompt: list[int], sid: str | None, pooled: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "n_predict": 12, "temperature": 0}
    if sid is not None:
        body["session_id"] = sid
    if pooled:
        body["pool_id"] = "root"
    if sid is None:
        body["cache_prompt"] = False  # a cold run: every token prefilled
    r = c.post("/completion", json=body, headers=headers)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def cold(c: httpx.Client, prompt: list[int]) -> list[int]:
    tokens: list[int] = turn(c, ADMIN, prompt, None, False)["tokens"]
    return tokens


def session_files(store: Path) -> list[Path]:
    return sorted(store.glob("*.pkvs"))


def header(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    (n,) = struct.unpack("<I", data[8:12])
    out: dict[str, Any] = json.loads(data[12 : 12 + n])
    return out


def subject(path: Path) -> tuple[dict[str, Any], str]:
    """A snapshot's fingerprint and subject, from its header."""
    key = header(path)["key"]
    return key["fingerprint"], key["subject"]


def who(tenant: str, sid: str) -> str:
    return hashlib.sha256(json.dumps([f"tenant:{tenant}", sid]).encode()).hexdigest()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("alpha: key-a\nbeta: key-b\n")
    return path


@pytest.fixture(scope="module")
def saved(
    start_engine: Callable[..., EngineProcess],
    tmp_path_factory: pytest.TempPathFactory,
    keys: Path,
) -> Iterator[tuple[Path, dict[str, list[int]]]]:
    """A store holding the pool and two sessions of tenant alpha, written by a real SIGTERM;
    each session's next prompt (its first, what it generated, and more)."""
    store = tmp_path_factory.mktemp("session-store")
    eng = boot(start_engine, store, "--api-key-file", str(keys))
    nxt = {}
    with client(eng) as c:
        create(c, "root")
        for sid, (prompt, pooled) in FIRST.items():
            done = turn(c, ALPHA, prompt, sid, pooled)
            nxt[sid] = prompt + done["tokens"] + NEXT
        # Its private tail went to host memory while "alone" ran: the parked bytes are saved.
        info = c.get("/polykv/sessions/pooled", headers=ALPHA).json()
        assert info["kv"] == "parked" and info["slot"] is not None
    assert eng.stop(timeout=120) == 0
    log = eng.log_path.read_text() if eng.log_path else ""
    assert "2 of 2 session cache(s) written" in log, eng.log_tail()
    assert len(session_files(store)) == 2
    yield store, nxt


def test_a_session_continues_from_its_saved_cache_after_a_restart(
    start_engine: Callable[..., EngineProcess],
    saved: tuple[Path, dict[str, list[int]]],
    keys: Path,
    tmp_path: Path,
) -> None:
    store, nxt = saved
    eng = boot(start_engine, copy_of(store, tmp_path), "--api-key-file", str(keys))
    with client(eng) as c:
        first_len = len(FIRST["pooled"][0])
        info = c.get("/polykv/sessions/pooled", headers=ALPHA)
        assert info.status_code == 200, info.text
        got = info.json()
        assert (got["kv"], got["slot"], got["state"]) == ("stored", None, "idle")
        assert got["ctx_used"] >= first_len
        # Another tenant's lookup of the same id names another file: nothing there.
        assert c.get("/polykv/sessions/pooled", headers=BETA).status_code == 404
        assert create(c, "root")["restore"]["source"] == "store"  # pools first, as at any start

        done = turn(c, ALPHA, nxt["pooled"], "pooled", True)
        assert done["timings"]["cache_n"] >= first_len  # the saved context, not a prefill
        # The session's first ROOT_LEN cells are the pool's: shared, never a second copy.
        lst = check_accounting(c)
        assert lst["kv_cells_used"] == len(nxt["pooled"]) + len(done["tokens"]) - 1
        assert c.get("/polykv/sessions/pooled", headers=ALPHA).json()["kv"] == "slot"
        assert done["tokens"] == cold(c, nxt["pooled"])

        alone = turn(c, ALPHA, nxt["alone"], "alone", False)
        assert alone["timings"]["cache_n"] >= len(FIRST["alone"][0])
        assert alone["tokens"] == cold(c, nxt["alone"])
        assert metric(c, 'polykv_session_restores_total{outcome="restored"}') == 2
        assert not session_files(Path(tmp_path / "store"))  # read once, then gone


def test_a_damaged_or_misplaced_session_file_costs_a_prefill_and_a_log_line(
    start_engine: Callable[..., EngineProcess],
    saved: tuple[Path, dict[str, list[int]]],
    keys: Path,
    tmp_path: Path,
) -> None:
    store, nxt = saved
    mine = copy_of(store, tmp_path)
    by_subject = {subject(p)[1]: p for p in session_files(mine)}
    pooled, alone = by_subject[who("alpha", "pooled")], by_subject[who("alpha", "alone")]
    data = bytearray(pooled.read_bytes())
    data[-100] ^= 0x40  # a payload byte
    pooled.write_bytes(bytes(data))
    # Alpha's file put under the name tenant beta's session "alone" would have.
    fp, _ = subject(alone)
    fingerprint = {"model": fp["model"], "build": fp["build"], "layout": fp["layout"]}
    beta_key = {"fingerprint": fingerprint, "kind": "session", "subject": who("beta", "alone"),
                "length": 0}  # fmt: skip
    text = json.dumps(beta_key, sort_keys=True, separators=(",", ":"))
    alone.rename(mine / f"{hashlib.sha256(text.encode()).hexdigest()}.pkvs")

    eng = boot(start_engine, mine, "--api-key-file", str(keys))
    with client(eng) as c:
        create(c, "root")
        done = turn(c, ALPHA, nxt["pooled"], "pooled", True)
        assert done["timings"]["cache_n"] <= ROOT_LEN  # the pool's cells only: prefilled
        assert done["tokens"] == cold(c, nxt["pooled"])
        other = turn(c, BETA, nxt["alone"], "alone", False)
        assert other["timings"]["cache_n"] == 0
        assert other["tokens"] == cold(c, nxt["alone"])
        for reason in ("corrupt", "other_prefix"):
            assert metric(c, f'polykv_snapshot_refusals_total{{reason="{reason}"}}') == 1
        assert metric(c, 'polykv_session_restores_total{outcome="refused"}') == 2
        assert c.get("/health").status_code == 200
    log = eng.log_path.read_text() if eng.log_path else ""
    assert "refused (corrupt)" in log and "refused (other_prefix)" in log, eng.log_tail()
    assert not session_files(mine)  # refused files are removed


def test_the_byte_budget_and_the_deadline_bound_what_is_written(
    start_engine: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    # 512 bytes a token here: a 1,200-token session is 0.6 MiB, two do not fit in 1 MiB.
    runs = {
        "budget": ("--polykv-session-save-mib", "1"),
        "deadline": ("--polykv-session-save-s", "0"),
    }
    for name, flags in runs.items():
        store = tmp_path / name
        eng = boot(start_engine, store, *flags)
        with client(eng) as c:
            for i, sid in enumerate(("older", "newer")):
                prompt = [(j * 131 + i) % 900 + 5 for j in range(1200)]
                turn(c, ADMIN, prompt, sid, False)
        assert eng.stop(timeout=120) == 0
        log = eng.log_path.read_text() if eng.log_path else ""
        if name == "budget":  # the most recently used session is written, the other not
            assert "not written: over the byte budget" in log, eng.log_tail()
            (path,) = session_files(store)
            assert header(path)["tokens"][0] == 6  # the newer session's first token
        else:
            assert "not written: the deadline passed" in log, eng.log_tail()
            assert not session_files(store)


@pytest.mark.parametrize("kind", ["swa", "mamba", "jamba"])
def test_sliding_window_and_recurrent_sessions_continue_after_a_restart(
    start_on: Callable[..., EngineProcess],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kind: str,
) -> None:
    """A sliding-window session is saved a window at a time (llama.cpp's writer would leave
    out the cells its last token no longer sees); a recurrent one with its state at the end."""
    model = request.getfixturevalue(f"{kind}_model")
    args = ("-np", "2", "-c", "2048", "--polykv-admin-key", "admin-key", "--metrics",
            "--polykv-snapshot-dir", str(tmp_path / "store"), *DETERMINISTIC)  # fmt: skip
    first = start_on(model, *args)
    prompt = [(i * 389) % 900 + 5 for i in range(300)]
    with client(first) as c:
        nxt = prompt + turn(c, ADMIN, prompt, "s", False)["tokens"] + NEXT
    assert first.stop(timeout=120) == 0
    assert len(session_files(tmp_path / "store")) == 1
    again = start_on(model, *args)
    with client(again) as c:
        done = turn(c, ADMIN, nxt, "s", False)
        assert done["timings"]["cache_n"] >= len(prompt)
        assert done["tokens"] == cold(c, nxt)
        assert metric(c, 'polykv_session_restores_total{outcome="restored"}') == 1
