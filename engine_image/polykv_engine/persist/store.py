"""The snapshot store: a directory of snapshot files, bounded in bytes (thread-safe).

Files are written by one background thread (the engine thread only hands over the bytes it
copied out of the KV cache), to a temporary name, flushed, then renamed: a crash or a full
disk leaves no file under a snapshot's name that is not whole, and temporary leftovers are
removed at start. When the bound would be passed, the least recently used files go first;
a snapshot larger than the whole bound is not written. A write that fails (disk full, I/O
error) is counted and skipped: serving goes on, and the pool is prefilled next time.

Sessions' caches (written at shutdown, ``core.session_snapshots``) are files of their own
suffix: a session file makes room by removing older session files only, never a pool's
(pools rebuild the whole tree; a session is one agent's context), and the peer route, which
serves pool files by digest, never finds one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from polykv_engine.persist import fileformat
from polykv_engine.persist.fileformat import KVSnapshot, SnapshotRefused, Span
from polykv_engine.persist.key import Fingerprint, SnapshotKey, pool_key, session_key

log = logging.getLogger("polykv.snapshots")

SUFFIX = ".pkv"
SESSION_SUFFIX = ".pkvs"
TEMP_PREFIX = ".incoming-"
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
# Bytes a snapshot may hold beyond its cells: the header, and llama.cpp's per-span and
# per-cell metadata (a position, a sequence count and id per cell and cache).
SPAN_OVERHEAD = 64 << 10
CELL_OVERHEAD = 64
HEADER_BYTES = 1 << 20
MAX_PENDING_BYTES = 1 << 30  # copies waiting for the writer beyond the first one

WriteSkip = str  # "too_large" | "busy" | "disk_full" | "write_failed"
SessionSave = str  # "written" | "over_budget" | "deadline" | "not_whole" | "write_failed"
SessionRestore = str  # "restored" | "refused" | "unused"


def private_file(path: Path) -> BinaryIO:
    """A new file only this user reads: a snapshot holds a prompt's KV (its text, nearly)."""
    return open(path, "xb", opener=lambda p, flags: os.open(p, flags, 0o600))


@dataclass(slots=True)
class StoreStats:
    """Totals since boot, read by /metrics (``http.metrics``)."""

    bytes_written: int = 0
    files_written: int = 0
    bytes_read: Counter[str] = field(default_factory=Counter)  # by source: store, peer
    skipped: Counter[str] = field(default_factory=Counter)  # writes not done, by reason
    refusals: Counter[str] = field(default_factory=Counter)  # restores refused, by reason
    session_saves: Counter[str] = field(default_factory=Counter)  # at shutdown, by outcome
    session_restores: Counter[str] = field(default_factory=Counter)  # by outcome


@dataclass(frozen=True, slots=True)
class _Job:
    key: SnapshotKey | None  # None: a marker that the writes before it are done
    spans: tuple[Span, ...]
    end: int
    tokens: tuple[int, ...] | None
    size: int
    done: threading.Event | None = None
    written: list[bool] = field(default_factory=list)  # [True] once the file is in place


class SnapshotStore:
    def __init__(
        self,
        root: Path,
        max_bytes: int,
        fingerprint: Fingerprint,
        bytes_per_token: int,
        state_bytes: int = 0,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self._per_token = bytes_per_token + CELL_OVERHEAD
        self._fixed = state_bytes + HEADER_BYTES
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, float]] = {}  # digest -> (bytes, last used)
        self._sessions: set[str] = set()  # the digests in _files that are session files
        self._pending = 0
        root.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="polykv-snapshots")
        self._writer.daemon = True
        self._writer.start()

    # ------------------------------------------------------------------ names and bounds

    def pool_key(self, tokens: Sequence[int]) -> SnapshotKey:
        return pool_key(self.fingerprint, tokens)

    def session_key(self, tenant: str, session_id: str) -> SnapshotKey:
        return session_key(self.fingerprint, tenant, session_id)

    def bound(self, n_positions: int, n_spans: int = 1, header_tokens: int = 0) -> int:
        """The most bytes a snapshot of ``n_positions`` cells may take here (larger files are
        refused before they are read): the cells at this model's size, llama.cpp's metadata,
        the header; never more than the store holds."""
        cells = n_positions * self._per_token + n_spans * SPAN_OVERHEAD
        return min(self.max_bytes, cells + self._fixed + header_tokens * 12)

    def path(self, digest: str) -> Path:
        """A pool snapshot's file (the only kind the peer route serves)."""
        if not DIGEST_RE.fullmatch(digest):
            raise ValueError(f"not a snapshot digest: {digest!r}")
        return self.root / f"{digest}{SUFFIX}"

    def path_of(self, key: SnapshotKey) -> Path:
        suffix = SESSION_SUFFIX if key.kind == "session" else SUFFIX
        return self.root / f"{key.digest}{suffix}"

    def _file(self, digest: str) -> Path:
        suffix = SESSION_SUFFIX if digest in self._sessions else SUFFIX
        return self.root / f"{digest}{suffix}"

    def size_of(self, digest: str) -> int | None:
        with self._lock:
            entry = self._files.get(digest)
        return entry[0] if entry else None

    def stats_now(self) -> StoreStats:
        """A copy of the totals (the writer thread updates them)."""
        with self._lock:
            st = self.stats
            return StoreStats(
                st.bytes_written,
                st.files_written,
                Counter(st.bytes_read),
                Counter(st.skipped),
                Counter(st.refusals),
                Counter(st.session_saves),
                Counter(st.session_restores),
            )

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(size for size, _ in self._files.values())

    @property
    def n_files(self) -> int:
        with self._lock:
            return len(self._files)

    # ------------------------------------------------------------------ reading

    def load(self, key: SnapshotKey, max_bytes: int, source: str = "store") -> KVSnapshot | None:
        """The snapshot stored under ``key`` (None: there is none). A file that fails its
        checks is removed and ``SnapshotRefused`` raised, with the reason counted."""
        path = self.path_of(key)
        try:
            snap = fileformat.read(path, key, max_bytes)
        except FileNotFoundError:
            return None
        except SnapshotRefused as exc:
            self.refused(exc.reason)
            log.warning("snapshot %s refused (%s): %s; removed", path.name, exc.reason, exc)
            self._remove(key.digest)
            raise
        except OSError as exc:
            self.refused("corrupt")
            raise SnapshotRefused("corrupt", f"cannot read {path.name}: {exc}") from exc
        with self._lock:
            self.stats.bytes_read[source] += snap.size
            self._files[key.digest] = (snap.size, time.time())
            if key.kind == "session":
                self._sessions.add(key.digest)
        return snap

    def refused(self, reason: str) -> None:
        with self._lock:
            self.stats.refusals[reason] += 1

    def find(self, key: SnapshotKey) -> int | None:
        """Bytes of the snapshot under ``key`` (None: there is none): from the index, else
        from the directory, which another process sharing it may have written to since
        this one's scan (an old pod's sessions, saved at its shutdown). May block on I/O."""
        size = self.size_of(key.digest)
        if size is not None:
            return size
        try:
            st = self.path_of(key).stat()
        except OSError:
            return None
        with self._lock:
            self._files[key.digest] = (st.st_size, st.st_mtime)
            if key.kind == "session":
                self._sessions.add(key.digest)
        return st.st_size

    def peek(self, key: SnapshotKey) -> tuple[int, int] | None:
        """(positions, bytes) of the snapshot stored under ``key``, from its header alone
        (None: none, or one that is not whole; its full checks come when it is loaded)."""
        if self.find(key) is None:
            return None
        try:
            _, end = fileformat.read_header(self.path_of(key), key)
        except (SnapshotRefused, OSError):
            return None
        size = self.size_of(key.digest)
        return (end, size) if size is not None else None

    def session_counted(
        self, saved: SessionSave | None = None, restored: SessionRestore | None = None
    ) -> None:
        with self._lock:
            if saved is not None:
                self.stats.session_saves[saved] += 1
            if restored is not None:
                self.stats.session_restores[restored] += 1

    def discard(self, key: SnapshotKey) -> None:
        """Remove the snapshot under ``key`` (a session's, once restored: its cells are in a
        slot now, and the next shutdown writes them again)."""
        self._remove(key.digest)

    def incoming(self) -> Path:
        """A temporary path in the store for a snapshot on its way in (a peer download)."""
        return self.root / f"{TEMP_PREFIX}{uuid.uuid4().hex}"

    def adopt(self, tmp: Path, key: SnapshotKey, max_bytes: int, source: str) -> KVSnapshot:
        """Check a downloaded file like a stored one and keep it under ``key``'s name, so
        this replica can restore it again, and serve it in turn. Refused: removed."""
        try:
            snap = fileformat.read(tmp, key, max_bytes)
        except (SnapshotRefused, OSError) as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            reason = exc.reason if isinstance(exc, SnapshotRefused) else "corrupt"
            self.refused(reason)
            if isinstance(exc, SnapshotRefused):
                raise
            raise SnapshotRefused("corrupt", str(exc)) from exc
        with self._lock:
            self.stats.bytes_read[source] += snap.size
            fits = snap.size <= self.max_bytes and self._make_room(snap.size)
        if fits:
            os.replace(tmp, self.path(key.digest))
            with self._lock:
                self._files[key.digest] = (snap.size, time.time())
        else:
            tmp.unlink(missing_ok=True)
        return snap

    # ------------------------------------------------------------------ writing

    def accepts(self, size: int) -> WriteSkip | None:
        """Why a snapshot of about ``size`` bytes would not be written now (None: it would),
        asked before the engine copies the cells out."""
        if size > self.max_bytes:
            return "too_large"
        with self._lock:
            if self._pending and self._pending + size > MAX_PENDING_BYTES:
                return "busy"
        return None

    def skip(self, reason: WriteSkip, what: str) -> None:
        with self._lock:
            self.stats.skipped[reason] += 1
        log.info("snapshot of %s not written: %s", what, reason)

    def save(
        self,
        key: SnapshotKey,
        spans: Sequence[Span],
        end: int,
        tokens: Sequence[int] | None = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> bool:
        """Write a snapshot on the writer thread; ``wait``: return once it is written (or
        skipped, or ``timeout`` passed: the writer goes on with it), True when it was
        written."""
        size = sum(len(s.data) for s in spans)
        job = _Job(
            key,
            tuple(spans),
            end,
            tuple(tokens) if tokens is not None else None,
            size,
            threading.Event() if wait else None,
        )
        with self._lock:
            self._pending += size
        self._jobs.put(job)
        if job.done is None:
            return False
        job.done.wait(timeout)
        return bool(job.written)

    def flush(self, timeout: float) -> bool:
        """Wait for the writes already handed over; False when ``timeout`` passed first."""
        done = threading.Event()
        self._jobs.put(_Job(None, (), 0, None, 0, done))
        return done.wait(timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._writer.join(timeout=60)

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if job.key is not None:
                    self._write(job, job.key)
            except Exception:  # a bug here must not stop later writes
                log.exception("snapshot writer failed")
            finally:
                with self._lock:
                    self._pending -= job.size
                if job.done is not None:
                    job.done.set()

    def _write(self, job: _Job, key: SnapshotKey) -> None:
        what = f"{key.kind} {key.subject[:12]}"
        head = fileformat.header(key, job.spans, job.end, job.tokens)
        total = len(head) + job.size
        session = key.kind == "session"
        with self._lock:
            room = total <= self.max_bytes and self._make_room(total, sessions_only=session)
        if not room:
            self.skip("too_large", what)
            return
        tmp = self.incoming()
        t0 = time.perf_counter()
        try:
            with private_file(tmp) as f:
                f.write(head)
                for span in job.spans:
                    f.write(span.data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path_of(key))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            self.skip("disk_full" if full else "write_failed", f"{what} ({exc})")
            return
        with self._lock:
            self._files[key.digest] = (total, time.time())
            if session:
                self._sessions.add(key.digest)
            self.stats.bytes_written += total
            self.stats.files_written += 1
        job.written.append(True)
        log.info(
            "snapshot of %s written: %d positions, %.1f MiB in %.2fs",
            what,
            job.end - (job.spans[0].start if job.spans else job.end),
            total / 2**20,
            time.perf_counter() - t0,
        )

    # ------------------------------------------------------------------ the directory

    def _scan(self) -> None:
        for path in self.root.iterdir():
            if path.name.startswith(TEMP_PREFIX):
                path.unlink(missing_ok=True)  # a write or download cut short: never whole
            elif path.suffix in (SUFFIX, SESSION_SUFFIX) and DIGEST_RE.fullmatch(path.stem):
                with contextlib.suppress(OSError):
                    st = path.stat()
                    self._files[path.stem] = (st.st_size, st.st_mtime)
                    if path.suffix == SESSION_SUFFIX:
                        self._sessions.add(path.stem)

    def _make_room(self, need: int, sessions_only: bool = False) -> bool:
        """Remove least recently used files until ``need`` more bytes fit (lock held);
        ``sessions_only``: session files alone may go."""
        used = sum(size for size, _ in self._files.values())
        for digest, _ in sorted(self._files.items(), key=lambda kv: kv[1][1]):
            if used + need <= self.max_bytes:
                break
            if sessions_only and digest not in self._sessions:
                continue
            path = self._file(digest)
            used -= self._files.pop(digest)[0]
            self._sessions.discard(digest)
            path.unlink(missing_ok=True)
        return used + need <= self.max_bytes

    def _remove(self, digest: str) -> None:
        with self._lock:
            self._files.pop(digest, None)
            self._sessions.discard(digest)
        for suffix in (SUFFIX, SESSION_SUFFIX):  # a file put there since the scan has no entry
            (self.root / f"{digest}{suffix}").unlink(missing_ok=True)
