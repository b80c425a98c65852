"""Pool and session references as URL path segments, checked before any request.

A reference goes into a path (``/polykv/pools/{ref}/...``), so one a caller (or a model)
chose could otherwise steer the request: httpx resolves ``..`` segments and treats ``?`` and
``#`` as the end of the path, so the pool ``../../slots/0?action=erase#`` would send the
admin key to ``/slots/0``. A reference is therefore checked against the engine's own rules
(``polykv_api.models``) and every segment is percent-encoded.
"""

from __future__ import annotations

import re
from urllib.parse import quote

from polykv_api import models as wire

from .errors import InvalidReference


def _refused(message: str, reason: wire.Reason) -> InvalidReference:
    return InvalidReference(None, message, "invalid_request_error", reason)


_POOL_NAME = re.compile(wire.POOL_NAME_PATTERN)
_SESSION_ID = re.compile(wire.SESSION_ID_PATTERN)
_POOL_ID = re.compile(r"^[0-9]{1,20}$")


def segment(text: str) -> str:
    """One path segment, percent-encoded (``/``, ``?``, ``#`` and ``%`` included); a dot
    segment is refused, as no encoding stops a URL parser resolving it."""
    if text in (".", ".."):
        raise _refused(f"{text!r} cannot be a path segment", "invalid_request")
    return quote(text, safe="")


def pool_ref(ref: wire.PoolRef) -> str:
    """A pool id (an int, or a string of digits) or a name the engine accepts, as a path
    segment; ``InvalidReference`` (reason ``name_invalid``) otherwise."""
    if isinstance(ref, bool) or not isinstance(ref, int | str):
        raise _refused(f"pool reference {ref!r}: an int id or a name", "name_invalid")
    if isinstance(ref, int):
        if ref < 0:
            raise _refused(f"pool id {ref}: must be >= 0", "name_invalid")
        return str(ref)
    if _POOL_ID.fullmatch(ref):
        return ref
    return segment(pool_name(ref))


def pool_name(name: str) -> str:
    """A name for a new pool, as the engine checks it (a string of digits is an id, never a
    name); ``InvalidReference`` (reason ``name_invalid``) otherwise."""
    if not isinstance(name, str) or not _POOL_NAME.fullmatch(name):
        raise _refused(
            f"pool name {name!r} is invalid: 1-253 characters of letters, digits, '.', '_', "
            "':' or '-', starting with a letter or digit, and not all digits",
            "name_invalid",
        )
    return name


def session_id(session: str) -> str:
    """A session id the engine accepts (1-256 visible ASCII characters), as a path segment."""
    if not isinstance(session, str) or not _SESSION_ID.fullmatch(session):
        raise _refused(
            f"session id {session!r} is invalid: 1-256 visible ASCII characters",
            "invalid_request",
        )
    return segment(session)
