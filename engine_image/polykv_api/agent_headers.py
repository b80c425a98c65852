"""Who a request is: the session, its parent, and whether it is the session's last turn,
from the headers agent clients already send (pure; the engine and the router read them the
same way).

Defaults, each checked against requests the real clients sent (Claude Code 2.1.328, Codex
0.169.0; ``shared/design/agent_clients.md``):

* Claude Code sends ``X-Claude-Code-Session-Id`` on every request of a run, and a sub-agent
  adds ``x-claude-code-agent-id``: the sub-agent is the session ``<session>:<agent>``, its
  parent the run's session.
* Codex sends ``session-id`` (the run) and ``thread-id`` (one per agent thread; a sub-agent
  keeps the run's ``session-id``, gets its own ``thread-id`` and names its parent's in
  ``x-codex-parent-thread-id``).
* ``x-session-id`` is PolyKV's own (and OpenCode's, with ``x-parent-session-id``); Dynamo's
  ``x-dynamo-session-id`` family is read too, and its ``-session-final``.

The first header of each list that a request carries wins; the body's ``session_id`` wins
over all of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from polykv_api.models import SESSION_ID_PATTERN

SESSION_HEADERS = (
    "x-session-id",
    "thread-id",  # Codex: one per agent thread
    "x-claude-code-session-id",
    "session-id",  # Codex: the run (its sub-agents share it)
    "x-dynamo-session-id",
)
AGENT_HEADERS = ("x-claude-code-agent-id",)  # qualifies the session: <session>:<agent>
PARENT_HEADERS = ("x-parent-session-id", "x-codex-parent-thread-id", "x-dynamo-parent-session-id")
FINAL_HEADERS = ("x-session-final", "x-dynamo-session-final")

_SESSION_ID = re.compile(SESSION_ID_PATTERN)
_TRUE = ("1", "true", "yes")


def header_names(text: str) -> tuple[str, ...]:
    """A comma-separated list of header names (empty: none), lower-cased; ValueError
    naming what is not a header name (the engine's and the router's flags)."""
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    bad = [n for n in names if not n.isascii() or not n.replace("-", "").isalnum()]
    if bad:
        raise ValueError(f"not header names: {', '.join(bad)}")
    return names


class HeaderError(ValueError):
    """A session header whose value cannot be a session id; the message names it."""


@dataclass(frozen=True, slots=True)
class SessionHeaders:
    """Which headers name a session, qualify it per agent, name its parent, and mark its
    last turn (``--polykv-session-headers`` and friends)."""

    session: tuple[str, ...] = SESSION_HEADERS
    agent: tuple[str, ...] = AGENT_HEADERS
    parent: tuple[str, ...] = PARENT_HEADERS
    final: tuple[str, ...] = FINAL_HEADERS


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    session: str | None
    parent: str | None = None
    final: bool = False  # release what was kept for the session after this turn


def _first(headers: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = headers.get(name)
        if value:
            return name, value
    return None


def _checked(name: str, value: str) -> str:
    if not _SESSION_ID.fullmatch(value):
        raise HeaderError(f"{name}: 1-256 visible ASCII characters (no spaces)")
    return value


def agent_identity(
    headers: Mapping[str, str], names: SessionHeaders, body_session: str | None = None
) -> AgentIdentity:
    """The request's identity (``headers`` looked up case-insensitively, as aiohttp's and
    httpx's are). HeaderError for a value that cannot be a session id."""
    found = _first(headers, names.session)
    session = body_session or (_checked(*found) if found else None)
    parent_found = _first(headers, names.parent)
    parent = _checked(*parent_found) if parent_found else None
    agent = _first(headers, names.agent)
    if agent is not None and session is not None and body_session is None:
        parent = parent or session
        session = _checked(agent[0], f"{session}:{agent[1]}")
    final = _first(headers, names.final)
    return AgentIdentity(session, parent, final is not None and final[1].lower() in _TRUE)
