"""persist: the snapshot file's checks and the store's bound (pure, files in tmp_path).

Every way a file can be wrong is refused with its reason before any byte would reach
llama.cpp; the store keeps its bound by dropping the least recently used files, never
leaves a half-written file under a snapshot's name, and skips (counts) what it cannot write.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from polykv_engine.persist import fileformat
from polykv_engine.persist.fileformat import SnapshotRefused, Span
from polykv_engine.persist.key import Fingerprint, pool_key, session_key, tokens_digest
from polykv_engine.persist.store import SnapshotStore

FP = Fingerprint("m" * 64, "b" * 64, "k=f16 v=f16 fa=on unified=1 swa_full=0 ngl=0")
TOKENS = list(range(1, 101))
SPANS = [Span(40, 72, b"a" * 320), Span(72, 100, b"b" * 280)]


def write(path: Path, key: object = None, spans: list[Span] = SPANS, **extra: object) -> Path:
    with open(path, "wb") as f:
        fileformat.write(f, key or pool_key(FP, TOKENS), spans, 100, **extra)  # type: ignore[arg-type]
    return path


def refusal(path: Path, key: object = None, max_bytes: int = 1 << 20) -> str:
    with pytest.raises(SnapshotRefused) as info:
        fileformat.read(path, key or pool_key(FP, TOKENS), max_bytes)  # type: ignore[arg-type]
    return info.value.reason


def rewrite_header(path: Path, change: dict[str, object]) -> None:
    data = path.read_bytes()
    n = struct.unpack("<I", data[8:12])[0]
    head = json.loads(data[12 : 12 + n])
    for dotted, value in change.items():
        node = head
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    text = json.dumps(head).encode()
    path.write_bytes(data[:8] + struct.pack("<I", len(text)) + text + data[12 + n :])


def test_a_written_snapshot_reads_back_span_by_span(tmp_path: Path) -> None:
    snap = fileformat.read(write(tmp_path / "s"), pool_key(FP, TOKENS), 1 << 20)
    assert (snap.start, snap.end) == (40, 100)
    assert [(s.start, s.end, bytes(s.data)) for s in snap.spans] == [
        (s.start, s.end, bytes(s.data)) for s in SPANS
    ]
    assert snap.payload_bytes == 600 and snap.tokens is None


def test_keys_name_model_build_layout_and_the_exact_tokens() -> None:
    key = pool_key(FP, TOKENS)
    assert key.digest == pool_key(FP, list(TOKENS)).digest
    assert key.digest != pool_key(FP, TOKENS[:-1]).digest
    assert key.digest != pool_key(Fingerprint("x" * 64, FP.build, FP.layout), TOKENS).digest
    assert key.digest != pool_key(Fingerprint(FP.model, FP.build, "k=f32"), TOKENS).digest
    assert tokens_digest([1, 2]) != tokens_digest([2, 1])
    assert session_key(FP, "t", "s").digest != session_key(FP, "t2", "s").digest


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b[:-10], "truncated"),
        (lambda b: b[:20], "truncated"),
        (lambda b: b[:5], "truncated"),
        (lambda b: b + b"x", "corrupt"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "corrupt"),
        (lambda b: b"NOTASNAP" + b[8:], "corrupt"),
        (lambda b: b[:8] + struct.pack("<I", 1 << 30) + b[12:], "corrupt"),
        (lambda b: b[:12] + b"[" + b[13:], "corrupt"),
    ],
)
def test_damaged_files_are_refused_with_their_reason(tmp_path: Path, damage, reason) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path / "s")
    path.write_bytes(damage(path.read_bytes()))
    assert refusal(path) == reason


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("key.fingerprint.model", "n" * 64, "other_model"),
        ("key.fingerprint.build", "c" * 64, "other_build"),
        ("format", 2, "other_build"),
        ("key.fingerprint.layout", "k=q8_0", "other_layout"),
        ("key.subject", "0" * 64, "other_prefix"),
        ("key.length", 99, "other_prefix"),
        ("spans", [[40, 70, 320], [72, 100, 280]], "corrupt"),
        ("spans", [[40, 72, 320]], "corrupt"),
        ("start", -1, "corrupt"),
        ("tokens", [1, 2], "corrupt"),
    ],
)
def test_a_header_that_does_not_match_is_refused(
    tmp_path: Path, field: str, value: object, reason: str
) -> None:
    path = write(tmp_path / "s")
    rewrite_header(path, {field: value})
    assert refusal(path) == reason


def test_a_file_larger_than_its_bound_is_refused_unread(tmp_path: Path) -> None:
    path = write(tmp_path / "s")
    assert refusal(path, max_bytes=path.stat().st_size - 1) == "too_large"


def test_a_session_snapshot_carries_its_tokens(tmp_path: Path) -> None:
    key = session_key(FP, "tenant", "sess")
    path = write(tmp_path / "s", key, tokens=list(range(100)))
    snap = fileformat.read(path, key, 1 << 20)
    assert snap.tokens == tuple(range(100))


def store(tmp_path: Path, max_bytes: int = 1 << 20) -> SnapshotStore:
    return SnapshotStore(tmp_path / "store", max_bytes, FP, bytes_per_token=10)


def test_the_store_writes_loads_and_drops_the_least_recently_used(tmp_path: Path) -> None:
    s = store(tmp_path, max_bytes=3000)
    keys = [pool_key(FP, TOKENS[: 100 - i]) for i in range(3)]
    for key in keys[:2]:
        s.save(key, SPANS, 100, wait=True)
    assert s.n_files == 2 and 0 < s.used_bytes <= 3000
    assert s.load(keys[0], 1 << 20) is not None  # keys[0] is now the most recently used
    s.save(keys[2], SPANS, 100, wait=True)  # three do not fit: keys[1] goes
    assert s.load(keys[1], 1 << 20) is None
    assert s.load(keys[0], 1 << 20) is not None and s.load(keys[2], 1 << 20) is not None
    assert s.stats_now().files_written == 3 and s.stats_now().bytes_read["store"] > 0
    s.close()


def test_snapshot_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(pool_key(FP, TOKENS), SPANS, 100, wait=True)
    (path,) = (tmp_path / "store").iterdir()
    assert path.stat().st_mode & 0o777 == 0o600  # whatever the umask
    s.close()


def test_a_snapshot_larger_than_the_store_is_skipped_and_counted(tmp_path: Path) -> None:
    s = store(tmp_path, max_bytes=500)
    assert s.accepts(600) == "too_large"
    s.save(pool_key(FP, TOKENS), SPANS, 100, wait=True)  # 600 payload bytes and a header
    assert s.n_files == 0 and s.stats_now().skipped["too_large"] == 1
    assert not list((tmp_path / "store").iterdir())
    s.close()


def test_a_refused_file_is_removed_and_leftovers_are_cleared_at_start(tmp_path: Path) -> None:
    s = store(tmp_path)
    key = pool_key(FP, TOKENS)
    s.save(key, SPANS, 100, wait=True)
    path = s.path(key.digest)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(SnapshotRefused):
        s.load(key, 1 << 20)
    assert not path.exists() and s.stats_now().refusals["truncated"] == 1
    s.close()
    leftover = tmp_path / "store" / ".incoming-half-written"
    leftover.write_bytes(b"x")
    s = store(tmp_path)
    assert not leftover.exists() and s.n_files == 0
    s.close()


def test_a_downloaded_file_is_checked_before_it_is_kept(tmp_path: Path) -> None:
    s = store(tmp_path)
    key = pool_key(FP, TOKENS)
    good = write(s.incoming(), key)
    assert s.adopt(good, key, 1 << 20, "peer").end == 100
    assert s.path(key.digest).exists() and s.stats_now().bytes_read["peer"] > 0
    bad = write(s.incoming(), key)
    bad.write_bytes(bad.read_bytes()[:-1])
    other = pool_key(FP, TOKENS[:50])
    with pytest.raises(SnapshotRefused):
        s.adopt(bad, other, 1 << 20, "peer")
    assert not bad.exists() and not s.path(other.digest).exists()
    s.close()


def test_bad_digests_never_name_a_path() -> None:
    s = SnapshotStore.__new__(SnapshotStore)
    s.root = Path("/nonexistent")
    for digest in ("../etc/passwd", "A" * 64, "a" * 63, "a" * 64 + "/x"):
        with pytest.raises(ValueError):
            s.path(digest)


def test_session_files_make_room_from_session_files_only(tmp_path: Path) -> None:
    s = store(tmp_path, max_bytes=3000)
    pool = pool_key(FP, TOKENS)
    old, new = session_key(FP, "t", "old"), session_key(FP, "t", "new")
    s.save(pool, SPANS, 100, wait=True)  # the oldest file
    assert s.save(old, SPANS, 100, tokens=TOKENS, wait=True)
    assert s.save(new, SPANS, 100, tokens=TOKENS, wait=True)  # the older session goes
    assert s.load(old, 1 << 20) is None and s.load(pool, 1 << 20) is not None
    assert s.path_of(new).suffix == ".pkvs" and not s.path(new.digest).exists()  # no peer sees it
    assert s.peek(new) == (100, s.size_of(new.digest))
    assert s.peek(session_key(FP, "other tenant", "new")) is None
    s.discard(new)
    assert not s.path_of(new).exists() and s.peek(new) is None
    assert s.save(old, SPANS, 100, tokens=TOKENS, wait=True)
    s.close()
    s = store(tmp_path, max_bytes=3000)  # a restart finds both kinds again
    assert s.n_files == 2 and s.peek(old) == (100, s.size_of(old.digest))
    s.close()


def test_a_session_file_another_process_wrote_since_the_scan_is_found(tmp_path: Path) -> None:
    reader, writer = store(tmp_path), store(tmp_path)  # two processes on one directory
    key = session_key(FP, "t", "s")
    assert writer.save(key, SPANS, 100, tokens=TOKENS, wait=True)
    assert reader.size_of(key.digest) is None  # not in its index
    assert reader.find(key) == writer.size_of(key.digest)
    snap = reader.load(key, 1 << 20)
    assert snap is not None and snap.tokens == tuple(TOKENS)
    reader.close()
    writer.close()
