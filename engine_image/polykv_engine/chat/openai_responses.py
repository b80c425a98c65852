"""OpenAI Responses requests as the engine's chat messages, and the reply back (pure).

``instructions`` and leading system/developer items become the system message; messages,
``function_call`` and ``function_call_output`` items become turns, tool calls and tool
results, as ``/v1/chat/completions`` takes them. Tools in a ``namespace`` are offered to the
model as ``namespace.name`` (a name OpenAI's own tools cannot have: they allow no dots) and
split back on the way out. ``previous_response_id`` supplies the turns before ``input``.
"""

from __future__ import annotations

from typing import Any

from polykv_api.models import ChatMessage
from polykv_api.openai_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ResponsesRequest,
)
from polykv_engine.chat.turns import (
    ChatForm,
    Role,
    add_call,
    add_result,
    add_text,
    function_call,
)

NAMESPACE_SEP = "."
ROLES: dict[str, Role] = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}


def qualified(name: str, namespace: str | None) -> str:
    return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


def split_name(name: str) -> tuple[str, str | None]:
    """(name, namespace) of a tool the model called."""
    namespace, sep, inner = name.partition(NAMESPACE_SEP)
    return (inner, namespace) if sep else (name, None)


def _function(tool: FunctionTool, namespace: str | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {
        "name": qualified(tool.name, namespace),
        "parameters": tool.parameters or {"type": "object", "properties": {}},
    }
    if tool.description is not None:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    out: list[dict[str, Any]] = []
    for tool in req.tools or []:
        if isinstance(tool, FunctionTool):
            out.append(_function(tool))
        else:
            out.extend(_function(t, tool.name) for t in tool.tools)
    return out or None


def _tool_choice(req: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise ValueError(f'tool_choice: {choice!r} is not "auto", "none" or "required"')
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        name = qualified(choice["name"], choice.get("namespace"))
        return {"type": "function", "function": {"name": name}}
    raise ValueError(
        f"tool_choice of type {choice.get('type')!r} is not supported: give "
        '"auto", "none", "required" or {"type": "function", "name": ...}'
    )


def turns(items: str | list[Any], out: list[ChatMessage]) -> None:
    """Append the conversation of ``input`` to ``out``."""
    if isinstance(items, str):
        add_text(out, "user", items)
        return
    for item in items:
        if isinstance(item, MessageItem):
            add_text(out, ROLES[item.role], item.text())
        elif isinstance(item, FunctionCallItem):
            name = qualified(item.name, item.namespace)
            add_call(out, function_call(item.call_id, name, item.arguments))
        elif isinstance(item, FunctionCallOutputItem):
            add_result(out, item.call_id, item.text())


def chat_form(
    req: ResponsesRequest, earlier: list[ChatMessage]
) -> tuple[ChatForm, list[ChatMessage]]:
    """The request as chat messages, and the conversation so far without
    ``instructions`` (which a later ``previous_response_id`` does not carry): the turns
    ``earlier`` (from ``previous_response_id``), then ``input``'s."""
    history = list(earlier)
    turns(req.input, history)
    out: list[ChatMessage] = []
    if req.instructions:
        add_text(out, "system", req.instructions)
    for m in history:
        if m.role == "system":
            add_text(out, "system", m.text())
        else:
            out.append(m)
    form = ChatForm(out, _tools(req), _tool_choice(req), req.parallel_tool_calls)
    return form, history
