"""Agent identity from the headers real clients send (pure); each case is a header set
captured from the client it names (shared/design/agent_clients.md)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from polykv_api.agent_headers import AgentIdentity, HeaderError, SessionHeaders, agent_identity

DEFAULTS = SessionHeaders()
RUN = "1a43f10d-bdc7-4591-9a13-bc6a7fd53e78"
THREAD = "01a23b6e-e0b6-7052-91af-d02d4eb2bab8"


def who(headers: dict[str, str], body: str | None = None) -> AgentIdentity:
    return agent_identity(CIMultiDict(headers), DEFAULTS, body)


def test_claude_code_run_and_its_sub_agent() -> None:
    assert who({"X-Claude-Code-Session-Id": RUN}) == AgentIdentity(RUN)
    sub = who({"X-Claude-Code-Session-Id": RUN, "x-claude-code-agent-id": "aacd494a0ba00276f"})
    assert sub == AgentIdentity(f"{RUN}:aacd494a0ba00276f", parent=RUN)


def test_codex_run_and_its_sub_agent() -> None:
    root = who({"session-id": RUN, "thread-id": RUN})
    assert root == AgentIdentity(RUN)
    sub = who({"session-id": RUN, "thread-id": THREAD, "x-codex-parent-thread-id": RUN})
    assert sub == AgentIdentity(THREAD, parent=RUN)


def test_polykv_opencode_and_dynamo_headers() -> None:
    assert who({"x-session-id": "s", "x-parent-session-id": "p"}) == AgentIdentity("s", "p")
    dyn = who({"X-Dynamo-Session-ID": "d", "X-Dynamo-Session-Final": "true"})
    assert dyn == AgentIdentity("d", final=True)
    assert who({"x-session-id": "s", "x-session-final": "0"}).final is False
    # The body's session_id wins over every header, and is not qualified by an agent id.
    both = who({"x-session-id": "h", "x-claude-code-agent-id": "a"}, body="b")
    assert both == AgentIdentity("b")
    assert who({}) == AgentIdentity(None)


def test_bad_values_are_refused_naming_the_header() -> None:
    with pytest.raises(HeaderError, match="x-claude-code-session-id"):
        who({"x-claude-code-session-id": "has space"})
    with pytest.raises(HeaderError, match="x-codex-parent-thread-id"):
        who({"thread-id": "t", "x-codex-parent-thread-id": "x" * 300})
    with pytest.raises(HeaderError, match="x-claude-code-agent-id"):
        who({"x-claude-code-session-id": "s" * 250, "x-claude-code-agent-id": "a" * 10})


def test_configured_lists_replace_the_defaults() -> None:
    only = SessionHeaders(session=("x-my-session",), agent=(), parent=(), final=())
    headers = CIMultiDict({"x-my-session": "m", "x-session-id": "ignored", "x-session-final": "1"})
    assert agent_identity(headers, only) == AgentIdentity("m")
