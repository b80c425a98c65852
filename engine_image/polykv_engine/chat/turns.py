"""Conversations from the agent APIs (Anthropic Messages, OpenAI Responses) as the chat
messages every template renders (pure).

Both APIs allow turns that many chat templates refuse (Gemma's insists on user and
assistant alternating, after at most one system message): system turns later in the
conversation, consecutive user turns. They are joined here as the APIs themselves read
them, so whatever template the model has renders the conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from polykv_api.models import ChatMessage

Role = Literal["system", "user", "assistant"]

# Put into a request where a kept prefix ends: the prompt rendered with it and the prompt
# rendered without it part there, which is how far the prefix reaches in tokens.
PREFIX_MARK = "\u2063[polykv-prefix-end]"


@dataclass(frozen=True, slots=True)
class ChatForm:
    """A request in the shape the chat template and tool planner take."""

    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool


def add_text(out: list[ChatMessage], role: Role, text: str) -> None:
    """A text turn. System text joins the opening system message while only system
    messages precede it, and is read as the user's later; consecutive user turns become one."""
    if role == "system":
        if all(m.role == "system" for m in out):
            if out:
                out[0] = ChatMessage(role="system", content=f"{out[0].text()}\n\n{text}")
            else:
                out.append(ChatMessage(role="system", content=text))
            return
        role = "user"
    last = out[-1] if out else None
    if role == "user" and last is not None and last.role == "user":
        out[-1] = ChatMessage(role="user", content=f"{last.text()}\n\n{text}")
    else:
        out.append(ChatMessage(role=role, content=text))


def add_call(out: list[ChatMessage], call: dict[str, Any]) -> None:
    """An OpenAI tool call; it joins the assistant turn right before it (its text, or
    calls made together)."""
    last = out[-1] if out else None
    if last is not None and last.role == "assistant":
        out[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
    else:
        out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def add_result(out: list[ChatMessage], call_id: str, text: str) -> None:
    out.append(ChatMessage(role="tool", content=text, tool_call_id=call_id))


def mark_last_user(messages: list[ChatMessage]) -> list[ChatMessage] | None:
    """The messages with ``PREFIX_MARK`` opening the last user turn's text (all before it is
    what the next turn of the conversation shares); None without a user turn."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            marked = messages[i].model_copy(update={"content": PREFIX_MARK + messages[i].text()})
            return [*messages[:i], marked, *messages[i + 1 :]]
    return None


def function_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
