"""What makes saved KV bytes valid, and the name a snapshot is stored under (pure).

Cells computed by one model file, one llama.cpp build and one cache layout mean nothing to
any other: a snapshot's key carries all three, plus a digest of the tokens whose cells it
holds. A lookup computes the key the running engine would write and finds the file by its
name; the header's own copy of the key is compared field by field on load, so a file that
is somewhere it should not be is refused with the field that differs.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

READ_BLOCK = 8 << 20

Kind = Literal["pool", "session"]


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The running engine's model, build and cache layout, as digests and a layout line."""

    model: str  # sha256 of the GGUF file
    build: str  # sha256 over the llama.cpp libraries this process runs
    layout: str  # cache types, attention kernel, streams, memory kind ("k=f16 v=f16 ...")


def file_digest(path: Path) -> str:
    """sha256 of a file, read in blocks (a model file is gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def build_digest(files: Iterable[Path], label: str) -> str:
    """sha256 over ``label`` and the bytes of every library file, in the order given."""
    h = hashlib.sha256(label.encode())
    for path in files:
        h.update(str(path.name).encode())
        h.update(bytes.fromhex(file_digest(path)))
    return h.hexdigest()


def tokens_digest(tokens: Sequence[int]) -> str:
    """sha256 of the token ids as little-endian int32: names a prefix exactly (no rolling
    64-bit hash: a collision here would restore another prefix's cells)."""
    ids = array("i", tokens)
    if ids.itemsize != 4:  # pragma: no cover - every platform llama.cpp builds on
        raise RuntimeError("int is not 32 bits here")
    return hashlib.sha256(ids.tobytes()).hexdigest()


@dataclass(frozen=True, slots=True)
class SnapshotKey:
    """A snapshot's identity: whose cells (fingerprint), of what (a pool's prefix, or a
    session), and for how many positions."""

    fingerprint: Fingerprint
    kind: Kind
    subject: str  # a pool: tokens_digest of its prefix; a session: digest of tenant + id
    length: int  # positions [0, length) are what the cells continue

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def digest(self) -> str:
        """The file name's stem: 64 hex characters."""
        text = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def pool_key(fingerprint: Fingerprint, tokens: Sequence[int]) -> SnapshotKey:
    return SnapshotKey(fingerprint, "pool", tokens_digest(tokens), len(tokens))


def session_key(fingerprint: Fingerprint, tenant: str, session_id: str) -> SnapshotKey:
    """A session's snapshot is found by who it is, not by its tokens (the next pod does not
    know them); its length is in the header, and 0 here."""
    who = hashlib.sha256(json.dumps([tenant, session_id]).encode()).hexdigest()
    return SnapshotKey(fingerprint, "session", who, 0)
