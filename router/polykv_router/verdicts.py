"""Which client credentials the engines accept: a bounded cache of verdicts (pure; the
caller passes the time).

The router does no work for a client (session lookups, capacity polls, proxying) before
an engine has accepted that client's credentials once; the verdict is remembered here so
that check costs one engine call per key and TTL, not one per request. Keys are held only
as a SHA-256 of what the client sent: a dump of the router's memory shows no key.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

CREDENTIAL_HEADERS = ("authorization", "x-api-key")
"""Where the engine reads a key from (``Authorization: Bearer`` or ``X-Api-Key``)."""


def credentials(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of a request that carry its key, as they are to be shown to an engine."""
    return {h: headers[h] for h in CREDENTIAL_HEADERS if h in headers}


def fingerprint(creds: Mapping[str, str]) -> str:
    """One hash per distinct set of credentials (no credentials at all is one, too)."""
    h = hashlib.sha256()
    for name in CREDENTIAL_HEADERS:
        value = creds.get(name)
        h.update(b"\x01" if value is None else b"\x00" + value.encode("utf-8", "surrogateescape"))
        h.update(b"\xff")
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: bool
    until: float


class KeyVerdicts:
    """Least recently used first; at most ``max_keys`` entries. An accepted key is trusted
    for ``ok_ttl_s``, a refused one stays refused for ``refused_ttl_s`` (short: a key just
    added to the engines should not wait long)."""

    def __init__(self, max_keys: int, ok_ttl_s: float, refused_ttl_s: float) -> None:
        self.max_keys = max_keys
        self.ok_ttl_s = ok_ttl_s
        self.refused_ttl_s = refused_ttl_s
        self._table: OrderedDict[str, Verdict] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def get(self, key: str, now: float) -> bool | None:
        """The verdict on ``key``, or None when there is none (or it expired)."""
        v = self._table.get(key)
        if v is None:
            return None
        if now >= v.until:
            del self._table[key]
            return None
        self._table.move_to_end(key)
        return v.accepted

    def put(self, key: str, accepted: bool, now: float) -> None:
        ttl = self.ok_ttl_s if accepted else self.refused_ttl_s
        self._table.pop(key, None)
        self._table[key] = Verdict(accepted, now + ttl)
        while len(self._table) > self.max_keys:
            self._table.popitem(last=False)
