"""Anthropic Messages requests as the engine's chat messages, and its output back (pure).

The engine renders every chat through the model's template from OpenAI-style messages, so
a Messages request is translated on the way in: ``system`` becomes the system message,
``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages
(in the order the client gave them), tools their ``function`` form and ``tool_choice``
OpenAI's. A conversation therefore renders to the same tokens whichever API carries it, and
a session moving between the two keeps its cache.
"""

from __future__ import annotations

import json
from typing import Any

from polykv_api.anthropic import (
    Message,
    MessagesRequest,
    StopReason,
    TextBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
)
from polykv_api.models import ChatMessage
from polykv_engine.chat.turns import (
    PREFIX_MARK,
    ChatForm,
    Role,
    add_call,
    add_result,
    add_text,
    function_call,
)

# Claude Code opens its system prompt with a block of billing metadata for Anthropic's
# servers, different for every first user message (a hash of it): kept, it would make two
# runs' prompts part at their tenth token and share nothing.
BILLING_BLOCK = "x-anthropic-billing-header:"


def _system(req: MessagesRequest) -> str | None:
    if req.system is None:
        return None
    if isinstance(req.system, str):
        return req.system
    return "\n\n".join(b.text for b in req.system if not b.text.startswith(BILLING_BLOCK))


def _chat_messages(req: MessagesRequest) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    system = _system(req)
    if system:
        add_text(out, "system", system)
    for m in req.messages:
        role: Role = "assistant" if m.role == "assistant" else "user"
        if isinstance(m.content, str):
            add_text(out, role, m.content)
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in m.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(function_call(block.id, block.name, arguments))
            elif isinstance(block, ToolResultBlock):
                content = block.text()
                add_result(
                    out, block.tool_use_id, f"Error: {content}" if block.is_error else content
                )
        if texts:
            add_text(out, role, "".join(texts))
        for call in calls:
            add_call(out, call)
    return out


def _tools(req: MessagesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    tools = []
    for t in req.tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(req: MessagesRequest) -> tuple[str | dict[str, Any] | None, bool]:
    choice = req.tool_choice
    if choice is None:
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "any":
        return "required", parallel
    if choice.type == "tool":
        if not choice.name:
            raise ValueError('tool_choice: type "tool" needs the tool\'s name')
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return choice.type, parallel


def chat_form(req: MessagesRequest) -> ChatForm:
    """The request as chat messages, OpenAI tools and tool_choice (ValueError: a message
    naming the field)."""
    choice, parallel = _tool_choice(req)
    return ChatForm(_chat_messages(req), _tools(req), choice, parallel)


def _mark_tool(tool: Tool) -> None:
    tool.description = (tool.description or "") + PREFIX_MARK


def _mark_block(block: TextBlock | ToolUseBlock | ToolResultBlock) -> None:
    if isinstance(block, TextBlock):
        block.text += PREFIX_MARK
    elif isinstance(block, ToolUseBlock):
        block.input = {**block.input, PREFIX_MARK: ""}
    elif isinstance(block.content, str) or not block.content:
        block.content = f"{block.text()}{PREFIX_MARK}"
    else:
        block.content[-1].text += PREFIX_MARK


def _mark_message(message: Message) -> None:
    if isinstance(message.content, str):
        message.content += PREFIX_MARK
    elif message.content:
        _mark_block(message.content[-1])


def mark_last_breakpoint(req: MessagesRequest) -> MessagesRequest | None:
    """A copy of ``req`` with ``PREFIX_MARK`` after the content of its last
    ``cache_control`` breakpoint, in Anthropic's order (tools, system, messages; a top-level
    one marks the last message's end); None without a breakpoint."""
    out = req.model_copy(deep=True)
    marked: list[Tool | TextBlock | ToolUseBlock | ToolResultBlock] = list(out.tools or [])
    if isinstance(out.system, list):
        marked += out.system
    for m in out.messages:
        if isinstance(m.content, list):
            marked += m.content
    last = next((b for b in reversed(marked) if b.cache_control is not None), None)
    if out.cache_control is not None:
        _mark_message(out.messages[-1])
    elif isinstance(last, Tool):
        _mark_tool(last)
    elif last is not None:
        _mark_block(last)
    else:
        return None
    return out


def stop_reason(stop_type: str, tool_calls: bool) -> StopReason:
    """Anthropic's stop reason for how generation ended."""
    if stop_type == "limit":
        return "max_tokens"
    if tool_calls:
        return "tool_use"
    return "stop_sequence" if stop_type == "word" else "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's input object from the model's JSON text. Text cut short (max_tokens) or not
    an object gives an empty input: the block must hold an object, and ``stop_reason``
    already says the reply was cut."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
