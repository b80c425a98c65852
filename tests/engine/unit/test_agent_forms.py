"""Agent API requests in the engine's chat form (pure): Anthropic Messages, and the tool
schemas agent CLIs send turned into grammars."""

from __future__ import annotations

from typing import Any

import pytest

from polykv_api.anthropic import MessagesRequest
from polykv_engine.chat.anthropic import (
    chat_form,
    mark_last_breakpoint,
    stop_reason,
    tool_input,
)
from polykv_engine.chat.turns import PREFIX_MARK, ChatForm
from polykv_engine.http.kept_prefix import KeptPart
from polykv_engine.http.wire_anthropic import usage
from polykv_engine.llama.grammar import from_schema, int_range
from polykv_engine.pools import kept


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


def test_the_last_breakpoint_is_marked_in_anthropics_order() -> None:
    tool = {"name": "t", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    ask = {"role": "user", "content": [text("Hi.")]}
    marked = mark_last_breakpoint(
        MessagesRequest.model_validate({"max_tokens": 1, "messages": [ask], "tools": [tool]})
    )
    assert marked is not None and marked.tools is not None
    assert marked.tools[0].description == PREFIX_MARK  # the tool, the only one
    system = [text("Be brief."), {**text("Rules."), "cache_control": {"type": "ephemeral"}}]
    body = {"max_tokens": 1, "messages": [ask], "tools": [tool], "system": system}
    marked = mark_last_breakpoint(MessagesRequest.model_validate(body))
    assert marked is not None and isinstance(marked.system, list)
    assert marked.system[1].text == "Rules." + PREFIX_MARK  # system comes after tools
    assert marked.tools is not None and marked.tools[0].description is None
    call = {"type": "tool_use", "id": "c1", "name": "t", "input": {"a": 1},
            "cache_control": {"type": "ephemeral"}}  # fmt: skip
    turns = [ask, {"role": "assistant", "content": [call]}]
    marked = mark_last_breakpoint(MessagesRequest.model_validate({**body, "messages": turns}))
    assert marked is not None
    assert marked.messages[1].content[0].input == {"a": 1, PREFIX_MARK: ""}  # type: ignore[union-attr]
    top = MessagesRequest.model_validate({**body, "cache_control": {"type": "ephemeral"}})
    marked = mark_last_breakpoint(top)
    assert marked is not None and marked.messages[-1].content[-1].text == "Hi." + PREFIX_MARK  # type: ignore[union-attr]
    assert top.messages[-1].content[-1].text == "Hi."  # type: ignore[union-attr]  # a copy
    plain = MessagesRequest.model_validate({"max_tokens": 1, "messages": [ask]})
    assert mark_last_breakpoint(plain) is None and plain.cache_ttl() is None


def test_a_request_keeps_for_the_longest_ttl_its_breakpoints_ask() -> None:
    five = {**text("a"), "cache_control": {"type": "ephemeral"}}
    hour = {**text("b"), "cache_control": {"type": "ephemeral", "ttl": "1h"}}

    def ttl(*system: dict[str, Any]) -> str | None:
        body = {
            "max_tokens": 1,
            "system": list(system),
            "messages": [{"role": "user", "content": "x"}],
        }
        return MessagesRequest.model_validate(body).cache_ttl()

    assert ttl(five) == "5m" and ttl(hour, five) == "1h" and ttl(text("c")) is None
    assert kept.ttl_s("1h", 3600) == 3600 and kept.ttl_s(None, 3600) == 300
    assert kept.ttl_s("1h", 2) == 2


def test_usage_splits_read_created_and_plain_input() -> None:
    # A kept prefix of 100 tokens, 60 computed now (40 seeded from another): 40 read.
    u = usage(130, 100, 5, KeptPart(100, 60))
    assert (u["cache_read_input_tokens"], u["cache_creation_input_tokens"]) == (40, 60)
    assert u["input_tokens"] == 30 and u["output_tokens"] == 5
    # Kept already: all of it read, and the session's cache beyond it too.
    u = usage(130, 120, 5, KeptPart(100, 0))
    assert (u["cache_read_input_tokens"], u["cache_creation_input_tokens"]) == (120, 0)
    # Nothing kept: computed tokens are plain input.
    u = usage(130, 10, 5, KeptPart())
    assert (u["input_tokens"], u["cache_creation_input_tokens"]) == (120, 0)
