"""Tool-call formats: detection from templates, parsing of recorded model outputs, streamed
deltas that add up to the whole, grammars llama.cpp accepts."""

from __future__ import annotations

import itertools
import json

import pytest

from polykv_engine.chat.partial_json import NotJson, scan
from polykv_engine.chat.tools import (
    ArgsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
    ToolError,
    detect_format,
    plan,
    render_history,
    resolve_choice,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

# What models of each family really write (recorded from Qwen2.5, Llama 3.1, Mistral Nemo).
RECORDED = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    "llama3": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
    "generic": (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
}


def test_formats_are_read_off_the_template() -> None:
    assert detect_format("{{ '<tool_call>' }}{{ tools }}") == "hermes"
    assert detect_format("{% if tools %}[AVAILABLE_TOOLS]...[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect_format("Environment: ipython<|eot_id|>") == "llama3"
    assert detect_format("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}") == "generic"


@pytest.mark.parametrize("fmt", sorted(RECORDED))
def test_recorded_outputs_parse_to_content_and_calls(fmt: str) -> None:
    text, content, calls = RECORDED[fmt]
    p = ToolCallParser(fmt)  # type: ignore[arg-type]
    p.feed(text)
    p.finish()
    assert p.content == content
    assert [(c.name, c.arguments) for c in p.calls] == calls
    for c in p.calls:
        json.loads(c.arguments)
        assert c.id
    if fmt == "mistral":
        assert p.calls[0].id == "a1b2c3d4e"  # the model's own id is kept


@pytest.mark.parametrize("fmt", sorted(RECORDED))
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_deltas_add_up_to_the_whole(fmt: str, step: int) -> None:
    text, content, calls = RECORDED[fmt]
    ids = itertools.count()
    p = ToolCallParser(fmt, new_id=lambda: f"id{next(ids)}")  # type: ignore[arg-type]
    deltas = []
    for i in range(0, len(text), step):
        deltas += p.feed(text[i : i + step])
    deltas += p.finish()
    streamed_content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    assert streamed_content == content
    starts = [d.call for d in deltas if isinstance(d, CallStart)]
    assert [c.name for c in starts] == [name for name, _ in calls]
    for i, (_, args) in enumerate(calls):
        assert "".join(d.text for d in deltas if isinstance(d, ArgsDelta) and d.index == i) == args


def test_plain_text_passes_through_every_format() -> None:
    for fmt in ("hermes", "llama3", "mistral"):
        p = ToolCallParser(fmt)  # type: ignore[arg-type]
        out = p.feed("The answer is 42.") + p.finish()
        assert p.content == "The answer is 42." and not p.calls
        assert "".join(d.text for d in out if isinstance(d, ContentDelta)) == "The answer is 42."


def test_a_partial_marker_is_held_back_until_decided() -> None:
    p = ToolCallParser("hermes")
    assert p.feed("Sure <tool") == [ContentDelta("Sure")]
    assert p.feed("box is mine") == [ContentDelta(" <toolbox is mine")]


def test_generic_response_streams_its_text() -> None:
    p = ToolCallParser("generic")
    got = []
    for piece in ['{"resp', 'onse": "Hel', "lo \\u00e9", "t\\n", 'é"}']:
        got += p.feed(piece)
    got += p.finish()
    assert "".join(d.text for d in got if isinstance(d, ContentDelta)) == "Hello ét\né"
    assert not p.calls


def test_llama3_json_that_is_not_a_call_is_content() -> None:
    p = ToolCallParser("llama3")
    p.feed('{"answer": 42}')
    p.finish()
    assert p.content == '{"answer": 42}' and not p.calls


def test_partial_json_scanner() -> None:
    node = scan('{"a": [1, {"b": "x\\"y"}], "c": tr')
    assert not node.complete
    a = node.get("a")
    assert a is not None and a.complete and a.items[1][1].get("b").text == 'x"y'  # type: ignore[union-attr]
    c = node.get("c")
    assert c is not None and c.kind == "literal" and not c.complete
    with pytest.raises(NotJson):
        scan("{'single': 1}")
    assert scan('"ab\\u00').text == "ab"  # an escape cut in half is not decoded yet


def test_tool_choice_resolution_and_refusals() -> None:
    assert resolve_choice([WEATHER], None)[0] == "auto"
    assert resolve_choice(None, None)[0] == "none"
    mode, fns = resolve_choice(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}
    )
    assert mode == "required" and [f["name"] for f in fns] == ["get_time"]
    with pytest.raises(ToolError, match="not among the tools"):
        resolve_choice([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ToolError, match="needs tools"):
        resolve_choice(None, "required")
    with pytest.raises(ToolError, match="tool_choice must be"):
        resolve_choice([WEATHER], "sometimes")
    with pytest.raises(ToolError, match="tools"):
        resolve_choice([{"type": "function", "function": {}}], None)


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "generic"])
@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_plans_give_grammars_for_every_family(fmt: str, choice: str) -> None:
    p = plan(fmt, [WEATHER, TIME], choice)  # type: ignore[arg-type]
    assert p is not None
    if fmt != "generic" and choice == "none":
        assert p.grammar is None and not p.parse
        return
    assert p.grammar is not None and "root ::=" in p.grammar.gbnf
    assert bool(p.grammar.triggers) == (choice == "auto" and fmt != "generic")


def test_generic_history_renders_calls_and_results_as_its_json() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    out = render_history("generic", msgs, [WEATHER["function"]])
    assert out[0]["content"].startswith("Be brief.\n\nYou can call these functions:")
    assert json.loads(out[2]["content"])["tool_calls"][0]["arguments"] == {"city": "Paris"}
    assert json.loads(out[3]["content"])["tool_response"]["content"] == "18 C"
    hermes = render_history("hermes", msgs, [WEATHER["function"]])
    assert hermes[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    # A call cut short by max_tokens, replayed by the client: kept as the model wrote it.
    cut = [{**msgs[2], "tool_calls": [{"function": {"name": "f", "arguments": '{"a": "10'}}]}]
    assert render_history("hermes", cut, [])[0]["tool_calls"][0]["arguments"] == '{"a": "10'
    generic = json.loads(render_history("generic", cut, [WEATHER["function"]])[1]["content"])
    assert generic["tool_calls"][0]["arguments"] == '{"a": "10'
