"""The snapshot file: a header that says what the cells are, then llama.cpp's bytes (pure).

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON) | payload

The header holds the key (``persist.key``), the positions the cells cover, one entry per
span of the payload (each span is one ``llama_state_seq_get_data`` blob: a sliding-window
model's range is saved a window at a time, see ``kv.memory.save_spans``), and the payload's
sha256. A reader checks all of it, and the key against the one it expects, before a byte
reaches llama.cpp: a file that fails is refused with the reason, never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from polykv_api.models import SnapshotRefusal
from polykv_engine.persist.key import Fingerprint, SnapshotKey

MAGIC = b"PKVSNAP1"
FORMAT = 1
_LEN = struct.Struct("<I")
PREAMBLE = len(MAGIC) + _LEN.size
MAX_HEADER_BYTES = 16 << 20  # a session's tokens are in it: 128k tokens fit in a few MB


class SnapshotRefused(Exception):
    def __init__(self, reason: SnapshotRefusal, message: str) -> None:
        super().__init__(message)
        self.reason: SnapshotRefusal = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class Span:
    """One llama.cpp blob: the cells of positions [start, end)."""

    start: int
    end: int
    data: bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    key: SnapshotKey
    start: int  # the cells cover positions [start, end); [0, start) comes from elsewhere
    end: int
    spans: tuple[Span, ...]
    tokens: tuple[int, ...] | None = None  # a session's cached tokens, [0, end)
    size: int = 0  # bytes of the file

    @property
    def payload_bytes(self) -> int:
        return sum(len(s.data) for s in self.spans)


def header(
    key: SnapshotKey,
    spans: Sequence[Span],
    end: int,
    tokens: Sequence[int] | None = None,
) -> bytes:
    """The preamble and header for ``spans`` (the payload is their data, in order)."""
    h = hashlib.sha256()
    for span in spans:
        h.update(span.data)
    body = {
        "format": FORMAT,
        "key": key.as_dict(),
        "start": spans[0].start if spans else end,
        "end": end,
        "spans": [[s.start, s.end, len(s.data)] for s in spans],
        "payload_sha256": h.hexdigest(),
        "tokens": list(tokens) if tokens is not None else None,
    }
    text = json.dumps(body, separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(text)) + text


def write(f: BinaryIO, key: SnapshotKey, spans: Sequence[Span], end: int, **extra: Any) -> int:
    """Write a whole snapshot to ``f``; returns the bytes written."""
    head = header(key, spans, end, **extra)
    f.write(head)
    for span in spans:
        f.write(span.data)
    return len(head) + sum(len(s.data) for s in spans)


def read(path: Path, expect: SnapshotKey, max_bytes: int) -> KVSnapshot:
    """Read and check a snapshot; ``SnapshotRefused`` with the reason when it is not one the
    engine expecting ``expect`` may load. Never reads more than ``max_bytes``."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size > max_bytes:
            raise SnapshotRefused(
                "too_large", f"{size} bytes, more than the {max_bytes} accepted for it"
            )
        f.seek(0)
        buf = bytearray(size)
        got = f.readinto(buf)
    return parse(memoryview(buf)[:got], expect)


def read_header(path: Path, expect: SnapshotKey) -> tuple[int, int]:
    """The positions [start, end) a snapshot's cells cover, from its header alone, checked
    against ``expect`` (the payload is checked only by ``read``)."""
    with open(path, "rb") as f:
        pre = f.read(PREAMBLE)
        n_head = _preamble(memoryview(pre), 1 << 62)
        buf = pre + f.read(n_head)
    _, _, start, end, _, _ = _header(memoryview(buf), n_head, expect)
    return start, end


def _preamble(buf: memoryview, size: int) -> int:
    """The header's length, once the magic is checked."""
    if len(buf) < PREAMBLE:
        raise SnapshotRefused("truncated", f"{len(buf)} bytes: not even a header")
    if bytes(buf[: len(MAGIC)]) != MAGIC:
        raise SnapshotRefused("corrupt", "not a PolyKV snapshot (wrong magic)")
    (n_head,) = _LEN.unpack(buf[len(MAGIC) : PREAMBLE])
    if n_head > MAX_HEADER_BYTES:
        raise SnapshotRefused("corrupt", f"a {n_head}-byte header")
    if PREAMBLE + n_head > size:
        raise SnapshotRefused("truncated", f"the header needs {n_head} bytes, {size} in the file")
    return int(n_head)


def parse(buf: memoryview, expect: SnapshotKey) -> KVSnapshot:
    size = len(buf)
    n_head = _preamble(buf, size)
    found, spans, start, end, digest, tokens = _header(buf, n_head, expect)
    payload = buf[PREAMBLE + n_head :]
    need = sum(n for _, _, n in spans)
    if len(payload) < need:
        raise SnapshotRefused("truncated", f"{len(payload)} payload bytes of {need}")
    if len(payload) > need:
        raise SnapshotRefused("corrupt", f"{len(payload) - need} bytes after the payload")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise SnapshotRefused("corrupt", "the payload does not match its sha256")
    out, at = [], 0
    for a, b, n in spans:
        out.append(Span(a, b, payload[at : at + n]))
        at += n
    if tokens is not None:
        if not isinstance(tokens, list) or len(tokens) != end:
            raise SnapshotRefused("corrupt", "its token list does not cover its positions")
        tokens = tuple(int(t) for t in tokens)
    return KVSnapshot(found, start, end, tuple(out), tokens, size)


def _header(
    buf: memoryview, n_head: int, expect: SnapshotKey
) -> tuple[SnapshotKey, list[tuple[int, int, int]], int, int, str, Any]:
    """The header's fields (key, spans, start, end, payload sha256, tokens), checked
    against ``expect``."""
    try:
        head = json.loads(bytes(buf[PREAMBLE : PREAMBLE + n_head]))
        fmt, key, start, end = head["format"], head["key"], head["start"], head["end"]
        spans = [(int(a), int(b), int(n)) for a, b, n in head["spans"]]
        digest, tokens = str(head["payload_sha256"]), head["tokens"]
        fp = key["fingerprint"]
        found = SnapshotKey(
            Fingerprint(str(fp["model"]), str(fp["build"]), str(fp["layout"])),
            key["kind"],
            str(key["subject"]),
            int(key["length"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotRefused("corrupt", f"unreadable header: {exc}") from exc
    if fmt != FORMAT:
        raise SnapshotRefused("other_build", f"snapshot format {fmt!r}, this engine reads {FORMAT}")
    _check_key(found, expect)
    _check_spans(spans, start, end)
    return found, spans, int(start), int(end), digest, tokens


def _check_key(found: SnapshotKey, expect: SnapshotKey) -> None:
    mine, theirs = expect.fingerprint, found.fingerprint
    if theirs.model != mine.model:
        raise SnapshotRefused(
            "other_model", f"written for model {theirs.model[:12]}, this is {mine.model[:12]}"
        )
    if theirs.build != mine.build:
        raise SnapshotRefused(
            "other_build",
            f"written by llama.cpp build {theirs.build[:12]}, this is {mine.build[:12]}",
        )
    if theirs.layout != mine.layout:
        raise SnapshotRefused(
            "other_layout", f"written with cache layout {theirs.layout!r}, this is {mine.layout!r}"
        )
    if (found.kind, found.subject, found.length) != (expect.kind, expect.subject, expect.length):
        raise SnapshotRefused(
            "other_prefix",
            f"holds {found.kind} {found.subject[:12]} ({found.length} positions), not "
            f"{expect.kind} {expect.subject[:12]} ({expect.length})",
        )


def _check_spans(spans: list[tuple[int, int, int]], start: object, end: object) -> None:
    if not isinstance(start, int) or not isinstance(end, int) or not 0 <= start <= end:
        raise SnapshotRefused("corrupt", f"positions [{start}, {end})")
    at = start
    for a, b, n in spans:
        if a != at or b <= a or n < 0:
            raise SnapshotRefused("corrupt", f"span [{a}, {b}) does not continue at {at}")
        at = b
    if at != end:
        raise SnapshotRefused("corrupt", f"its spans end at {at}, not {end}")
