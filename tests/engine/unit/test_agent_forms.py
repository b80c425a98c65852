"""Agent API requests in the engine's chat form (pure): Anthropic Messages, and the tool
schemas agent CLIs send turned into grammars."""

from __future__ import annotations

from typing import Any

import pytest

from polykv_api.anthropic import MessagesRequest
from polykv_engine.chat.anthropic import chat_form, stop_reason, tool_input
from polykv_engine.chat.turns import ChatForm
from polykv_engine.llama.grammar import from_schema, int_range


def text(t: str) -> dict[str, str]:
    return {"type": "text", "text": t}


def form(**body: Any) -> tuple[list[dict[str, Any]], ChatForm]:
    req = MessagesRequest.model_validate({"max_tokens": 8, **body})
    f = chat_form(req)
    return [m.model_dump(exclude_none=True) for m in f.messages], f


def test_system_blocks_billing_metadata_and_system_turns() -> None:
    messages, _ = form(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3.487;"},
            {"type": "text", "text": "You are an agent."},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [text("<reminder>"), text("Hi")]},
            {"role": "system", "content": "Later instructions."},
        ],
    )  # fmt: skip
    # The billing block goes (it differs per run); a system turn after the user's is the
    # user's, joined with it so templates that insist on alternating roles render it.
    assert messages == [
        {"role": "system", "content": "You are an agent.\n\nBe brief."},
        {"role": "user", "content": "<reminder>Hi\n\nLater instructions."},
    ]


def test_tool_use_and_results_become_calls_and_tool_messages() -> None:
    messages, f = form(
        messages=[
            {"role": "user", "content": "Time?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "clock", "input": {"zone": "UTC"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [text("12:00")]},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "boom",
                     "is_error": True},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        tools=[{"name": "clock", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    call = {
        "id": "t1",
        "type": "function",
        "function": {"name": "clock", "arguments": '{"zone": "UTC"}'},
    }
    assert messages == [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "content": "12:00", "tool_call_id": "t1"},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "t2"},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    clock = {"name": "clock", "parameters": {"type": "object"}, "description": "d"}
    assert f.tools == [{"type": "function", "function": clock}]
    assert (f.tool_choice, f.parallel_tool_calls) == ("required", False)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "clock"}, {"type": "function", "function": {"name": "clock"}}),
    ],
)
def test_tool_choice(choice: dict[str, object], expected: object) -> None:
    _, f = form(messages=[{"role": "user", "content": "x"}], tool_choice=choice)
    assert f.tool_choice == expected


def test_stop_reasons_and_cut_tool_input() -> None:
    assert stop_reason("limit", True) == "max_tokens"
    assert stop_reason("eos", True) == "tool_use"
    assert stop_reason("word", False) == "stop_sequence"
    assert stop_reason("eos", False) == "end_turn"
    assert tool_input('{"a": 1}') == {"a": 1}
    assert tool_input('{"a": ') == {} and tool_input("[1]") == {} and tool_input("") == {}


def test_annotation_only_subschemas_accept_any_value() -> None:
    # Claude Code's tools have properties described but not typed: any JSON value.
    schema = {
        "type": "object",
        "properties": {"args": {"description": "anything"}, "description": {"type": "string"}},
        "required": ["args", "description"],
    }
    gbnf = from_schema(schema)  # refused before: "Unrecognized schema"
    # "description" as a property's name is a name, not an annotation: still a string.
    assert 'description-kv ::= "\\"description\\"" space ":" space string' in gbnf


def test_integer_bounds_up_to_2_53_stay_small() -> None:
    # JavaScript's Number.MAX_SAFE_INTEGER as a maximum (Claude Code's Read tool) made 6.6 MB
    # of GBNF, over the grammar limit, because both ends of the range recursed apart.
    assert len(int_range(0, 9007199254740991)) < 4000
    assert (
        len(from_schema({"type": "integer", "minimum": -(2**53) + 1, "maximum": 2**53 - 1})) < 8000
    )
