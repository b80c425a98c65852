"""OpenAI's Responses API through the official ``openai`` package, on the generated model
(random weights: the contract is checked, not the words): the whole response and its
stream agree, function calls (also in a namespace) come back as ``function_call`` items and
go back in as ``function_call_output``, ``previous_response_id`` continues the same session
from its cache, and what is not supported is refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from polykv_engine.testing import EngineProcess

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
BRIEF = "You answer briefly."


def text(t: str) -> dict[str, str]:
    return {"type": "input_text", "text": t}


def sdk(engine: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def raw(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.base_url, timeout=120) as c:
        yield c


def test_text_whole_and_streamed_agree(engine: EngineProcess) -> None:
    client = sdk(engine)
    kw: dict[str, Any] = dict(
        model="m", instructions=BRIEF, input="Hello there", max_output_tokens=12, temperature=0
    )
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.model == "m"
    assert whole.status in ("completed", "incomplete")
    assert [o.type for o in whole.output] == ["message"]
    usage = whole.usage
    assert usage is not None and usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    kinds: list[str] = []
    deltas: list[str] = []
    numbers: list[int] = []
    for ev in client.responses.create(**kw, stream=True):
        kinds.append(ev.type)
        numbers.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            last = ev.response
    assert "".join(deltas) == whole.output_text == last.output_text
    assert numbers == list(range(len(numbers)))
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]


def test_function_calls_whole_streamed_and_answered(engine: EngineProcess) -> None:
    client = sdk(engine)
    kw: dict[str, Any] = dict(
        model="m",
        input="What is the weather in Paris?",
        tools=[WEATHER, TIME],
        tool_choice="required",
        # One call: the grammar then allows only the end of the reply, which even random
        # weights reach (with parallel calls they may write blanks until the limit).
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=0,
    )
    whole = client.responses.create(**kw)
    assert whole.status == "completed", whole
    (call,) = whole.output
    assert call.type == "function_call" and call.call_id and call.status == "completed"
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.name]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)

    args = ""
    with client.responses.stream(**kw) as stream:
        for ev in stream:
            if ev.type == "response.function_call_arguments.delta":
                args += ev.delta
        final = stream.get_final_response()
    assert json.loads(args) == json.loads(call.arguments)
    assert final.output[0].name == call.name  # type: ignore[union-attr]

    # The result goes back as a function_call_output after the call, and the reply runs on.
    answer = client.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."},
        ],
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert [o.type for o in answer.output] == ["message"]


def test_namespaced_tools_keep_their_namespace(engine: EngineProcess) -> None:
    agents = {
        "type": "namespace",
        "name": "agents",
        "description": "Sub-agents",
        "tools": [WEATHER],
    }
    resp = sdk(engine).responses.create(
        model="m", input="Weather?", tools=[agents], tool_choice="required",  # type: ignore[list-item]
        parallel_tool_calls=False, max_output_tokens=120, temperature=0,
    )  # fmt: skip
    (call,) = resp.output
    assert call.type == "function_call"
    assert (call.name, call.namespace) == ("get_weather", "agents")


def test_previous_response_id_continues_the_session_from_its_cache(engine: EngineProcess) -> None:
    client = sdk(engine)
    first = client.responses.create(
        model="m", instructions=BRIEF, input="Tell me about clocks. " * 6,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert first.usage is not None
    second = client.responses.create(
        model="m", instructions=BRIEF, input="And watches?", previous_response_id=first.id,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id and second.usage is not None
    # Everything the first turn computed is read back from the session's cache.
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens, (first.usage, second.usage)

    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    assert gone.value.body["reason"] == "response_not_found"  # type: ignore[index]


def test_a_final_turn_releases_the_session(engine: EngineProcess, raw: httpx.Client) -> None:
    client = sdk(engine)
    kw: dict[str, Any] = dict(model="m", input="Remember me. " * 8, max_output_tokens=4)
    first = client.responses.create(**kw, extra_headers={"session-id": "resp-final"})
    assert raw.get("/polykv/sessions/resp-final").status_code == 200
    client.responses.create(
        **kw, previous_response_id=first.id,
        extra_headers={"session-id": "resp-final", "x-session-final": "true"},
    )  # fmt: skip
    # Its cache and its responses are gone with it.
    assert raw.get("/polykv/sessions/resp-final").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**kw, previous_response_id=first.id)


def test_prompt_cache_key_keys_the_session_or_names_a_pool(
    engine: EngineProcess, raw: httpx.Client
) -> None:
    client = sdk(engine)
    client.responses.create(model="m", input="Hi", max_output_tokens=2, prompt_cache_key="pck-1")
    assert raw.get("/polykv/sessions/pck-1").status_code == 200
    shared = "A long shared preamble for every agent of the crew. " * 4
    r = raw.post(
        "/polykv/pools",
        json={"name": "pck-pool", "messages": [{"role": "system", "content": shared}]},
    )
    assert r.status_code == 201, r.text
    try:
        resp = client.responses.with_raw_response.create(
            model="m", instructions=shared, input="Hi", max_output_tokens=2,
            prompt_cache_key="pck-pool",
        )  # fmt: skip
        assert resp.headers["x-pool-id"] == str(r.json()["pool_id"])
        assert int(resp.headers["x-cached-prefix-tokens"]) > 0
    finally:
        raw.delete("/polykv/pools/pck-pool")


def test_prompt_cache_key_keeps_the_prefix_for_later_sessions(
    engine: EngineProcess, raw: httpx.Client
) -> None:
    """As OpenAI caches prompt prefixes, a ``prompt_cache_key`` keeps the prompt up to its
    newest user turn (instructions and tools): a later session, with another key, after
    the first one ended, reads it (``cached_tokens``)."""
    client = sdk(engine)
    kw: dict[str, Any] = dict(
        model="m", instructions="You run errands for the crew, one at a time. " * 10,
        tools=[WEATHER, TIME], max_output_tokens=2, extra_body={"temperature": 0},
    )  # fmt: skip
    final = {"x-session-final": "true"}
    first = client.responses.create(
        **kw, input="Plan the trip.", prompt_cache_key="pck-run-1", extra_headers=final
    )
    assert first.usage is not None
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert raw.get("/polykv/sessions/pck-run-1").status_code == 404  # its cache went
    second = client.responses.create(**kw, input="Check the weather.", prompt_cache_key="pck-run-2")
    assert second.usage is not None
    read = second.usage.input_tokens_details.cached_tokens
    pools = raw.get("/polykv/pools").json()["pools"]
    lengths = [p["prefix_len"] for p in pools if p["kept_until"] is not None]
    assert read > 64 and read in lengths, (read, lengths)
    # Without a key nothing more is kept.
    client.responses.create(**kw, input="Book it.", extra_headers=final)
    pools = raw.get("/polykv/pools").json()["pools"]
    assert len([p for p in pools if p["kept_until"] is not None]) == len(lengths)


def _refused(raw: httpx.Client, body: dict[str, Any], *needles: str) -> None:
    r = raw.post("/v1/responses", json={"model": "m", "input": "x", **body})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for needle in needles:
        assert needle in message, message


def test_unsupported_features_are_refused_by_name(raw: httpx.Client) -> None:
    _refused(raw, {"tools": [{"type": "web_search"}]}, "'web_search'", "built-in")
    _refused(raw, {"tools": [{"type": "file_search", "vector_store_ids": []}]}, "'file_search'")
    image = {"type": "input_image", "image_url": "data:,"}
    _refused(raw, {"input": [{"role": "user", "content": [image]}]}, "'input_image'")
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}
    _refused(raw, {"input": [reasoning]}, "'reasoning'")
    _refused(raw, {"background": True}, "background")
    _refused(raw, {"conversation": "conv_1"}, "conversation")
    _refused(raw, {"tool_choice": {"type": "web_search"}}, "tool_choice")
    _refused(raw, {"max_output_tokens": 2**31}, "max_output_tokens")
    _refused(raw, {"tools": [{**WEATHER, "name": f"t{i}"} for i in range(129)]}, "tools")


def test_codex_fields_are_accepted_and_named(raw: httpx.Client) -> None:
    body = {
        "model": "m",
        "input": [
            {"type": "message", "role": "developer", "content": [text("Be terse.")]},
            {"type": "message", "role": "user", "content": [text("Hi")]},
        ],
        "tools": [WEATHER],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "codex-like",
        "client_metadata": {"session_id": "s"},
        "max_output_tokens": 4,
        "temperature": 0,
    }  # fmt: skip
    r = raw.post("/v1/responses", json=body, headers={"session-id": "codex-run"})
    assert r.status_code == 200, r.text
    ignored = set(r.headers["X-PolyKV-Ignored-Fields"].split(","))
    assert {"reasoning", "store", "include", "client_metadata"} <= ignored
    assert r.headers["x-session-id"] == "codex-run"  # the header wins over prompt_cache_key
