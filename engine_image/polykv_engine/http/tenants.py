"""Tenants: which inference keys belong together, and who a request is.

Several inference keys are how tenants are told apart. A tenant's sessions, prompt caches
and automatic prefix sharing are its own; pools are the operator's and shared by design.

Key file (``--api-key-file``), one entry a line:

* ``KEY``: llama-server's format, the key is a tenant of its own;
* ``NAME: KEY``: the key belongs to tenant ``NAME`` (1-64 of ``A-Z a-z 0-9 . _ -``, starting
  with a letter or digit); several lines may name the same tenant;
* blank lines and lines starting with ``#`` are ignored.

Every ``--api-key`` (and ``LLAMA_API_KEY``) is a tenant of its own. Tenant ids are opaque to
everything below this module: the engine compares them and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NAMED_LINE = re.compile(rf"({TENANT_NAME.pattern}):\s+(\S+)")

OPEN_TENANT = "open"  # no inference key configured: everyone is one implicit tenant
ADMIN_TENANT = "admin"  # requests made with an admin key that is no tenant's key


class KeyFileError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class KeyEntry:
    key: str
    tenant: str | None  # None: the key is a tenant of its own


def parse_key_file(text: str) -> list[KeyEntry]:
    """The entries of a key file; errors name the line, never its content (a secret)."""
    out: list[KeyEntry] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        named = _NAMED_LINE.fullmatch(line)
        if named is not None:
            out.append(KeyEntry(named.group(2), named.group(1)))
        elif any(c.isspace() for c in line):
            raise KeyFileError(
                f"line {n}: expected KEY or NAME: KEY (a tenant name is 1-64 letters, digits, "
                "'.', '_' or '-')"
            )
        else:
            out.append(KeyEntry(line, None))
    return out


def assign_tenants(entries: Iterable[KeyEntry]) -> tuple[tuple[str, str], ...]:
    """(key, tenant id) for every key: named tenants by name, each unnamed key its own, named
    by a digest of the key. Ids outlive the process (a session's saved cache is found by its
    tenant's id), so an unnamed key's id never depends on where it is in the file: a key
    removed or moved would otherwise hand its sessions to the key that took its place."""
    out: list[tuple[str, str]] = []
    for e in entries:
        if e.tenant is not None:
            out.append((e.key, f"tenant:{e.tenant}"))
        else:
            out.append((e.key, f"key:{hashlib.sha256(encoded(e.key)).hexdigest()[:32]}"))
    return tuple(out)


def encoded(value: str) -> bytes:
    """A header value as bytes: aiohttp keeps bytes that are not UTF-8 as surrogates."""
    return value.encode("utf-8", "surrogateescape")


def key_matches(presented: str | None, keys: Sequence[str]) -> bool:
    """Constant-time, over every key (which one matched leaks nothing through timing)."""
    if presented is None:
        return False
    given = encoded(presented)
    hit = False
    for k in keys:
        hit |= hmac.compare_digest(given, encoded(k))
    return hit


def tenant_of(presented: str | None, key_tenants: Sequence[tuple[str, str]]) -> str | None:
    if presented is None:
        return None
    given = encoded(presented)
    found: str | None = None
    for key, tenant in key_tenants:
        if hmac.compare_digest(given, encoded(key)):
            found = tenant
    return found


@dataclass(frozen=True, slots=True)
class Identity:
    """Who sent a request, resolved once by the auth middleware."""

    tenant: str
    admin: bool = False  # the admin key (or no admin key configured on an open engine)
    router: bool = False  # the router's key came in X-PolyKV-Router-Key

    @property
    def trusted(self) -> bool:
        """May mark a request re-homed or overcommitted (the admin, or a router)."""
        return self.admin or self.router

    def sees(self, tenant: str | None) -> bool:
        """May see the ids and settings of a session of ``tenant``."""
        return self.admin or tenant == self.tenant
