"""Anthropic's Messages API through the official ``anthropic`` package, on the generated
model (random weights: the text is nonsense, the contract is what is checked): the whole
message and its stream agree, the event sequence is Anthropic's, tools come back as
``tool_use`` blocks, usage adds up and reports the cache, errors take Anthropic's shape and
bounds refuse before llama.cpp sees anything."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from polykv_engine.testing import EngineProcess
from tests.engine.http.test_admission import Load, saturated_pool, settled_and_active, wait_for

GREEDY = {"temperature": 0}  # the SDK no longer has sampling arguments: they go in the body
TIME_TOOL = {
    "name": "get_time",
    "description": "The time in a zone",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What time is it in Paris?"}]


def sdk(engine: EngineProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=engine.base_url, api_key="unused", max_retries=0)


def events(client: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The raw SSE stream of a streamed request as (event name, data) pairs."""
    out: list[tuple[str, dict[str, Any]]] = []
    name = ""
    with client.stream("POST", "/v1/messages?beta=true", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                out.append((name, data))
    return out


@pytest.fixture
def raw(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.base_url, timeout=120) as c:
        yield c


def test_message_whole_and_streamed_agree(engine: EngineProcess, raw: httpx.Client) -> None:
    client = sdk(engine)
    kw: dict[str, Any] = dict(
        model="m", max_tokens=16, system="Be brief.", messages=ASK, extra_body=GREEDY
    )
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "m"
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in whole.content] == ["text"]
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens

    seq = [name for name, _ in events(raw, {**kw.pop("extra_body"), **kw})]
    deltas = seq.count("content_block_delta")
    assert seq == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_usage_adds_up_and_reports_the_cache(engine: EngineProcess) -> None:
    client = sdk(engine)
    system = [
        {
            "type": "text",
            "text": "You answer questions about clocks. " * 8,
            "cache_control": {"type": "ephemeral"},
        }
    ]
    kw: dict[str, Any] = dict(model="m", max_tokens=4, system=system, messages=ASK)
    n = client.messages.count_tokens(model="m", system=system, messages=ASK).input_tokens
    hdr = {"x-session-id": "anthropic-usage"}
    first = client.messages.create(**kw, extra_body=GREEDY, extra_headers=hdr).usage
    assert (
        first.input_tokens + first.cache_creation_input_tokens + first.cache_read_input_tokens == n
    )  # type: ignore[operator]
    assert first.cache_creation_input_tokens and first.cache_creation_input_tokens > 0
    # The same prefix again in the same session: read from its cache, not computed.
    again = [*ASK, {"role": "assistant", "content": "Noon."}, {"role": "user", "content": "UTC?"}]
    second = client.messages.create(
        **{**kw, "messages": again}, extra_body=GREEDY, extra_headers=hdr
    ).usage
    assert second.cache_read_input_tokens is not None
    assert second.cache_read_input_tokens >= n - 1  # all but the prompt's last token

    # Without a breakpoint nothing is "created": computed tokens are plain input.
    plain = client.messages.create(
        model="m", max_tokens=4, messages=[{"role": "user", "content": "A fresh question?"}],
        extra_body=GREEDY,
    ).usage  # fmt: skip
    assert plain.cache_creation_input_tokens == 0 and plain.input_tokens > 0


def test_count_tokens_counts_past_the_context(
    start_engine: Callable[..., EngineProcess],
) -> None:
    """Anthropic's endpoint counts a prompt of any length (a client counts to know whether
    it fits); the body limit still bounds it, and only the request to run it is refused."""
    eng = start_engine("-np", "1", "-c", "512", "--polykv-max-body-bytes", "65536")
    client = sdk(eng)
    long_ask = [{"role": "user", "content": "How many clocks are in this house? " * 120}]
    n = client.messages.count_tokens(model="m", messages=long_ask).input_tokens
    assert n > 512
    short = client.messages.count_tokens(model="m", messages=ASK).input_tokens
    assert 0 < short < 512
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="m", max_tokens=4, messages=long_ask)
    assert refused.value.body["error"]["reason"] == "prompt_too_long"  # type: ignore[index]
    huge = [{"role": "user", "content": "x" * 70_000}]
    with pytest.raises(anthropic.APIStatusError) as too_big:
        client.messages.count_tokens(model="m", messages=huge)
    assert too_big.value.status_code == 413


def test_tool_use_whole_streamed_and_answered(engine: EngineProcess) -> None:
    client = sdk(engine)
    kw: dict[str, Any] = dict(
        model="m",
        max_tokens=120,
        messages=ASK,
        tools=[WEATHER_TOOL, TIME_TOOL],
        # One call: the grammar then allows only the end of the reply, which even random
        # weights reach (with parallel calls they may write blanks until max_tokens).
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "tool_use", whole
    (call,) = [b for b in whole.content if b.type == "tool_use"]
    tool = {"get_time": TIME_TOOL, "get_weather": WEATHER_TOOL}[call.name]
    assert call.id
    jsonschema.validate(call.input, tool["input_schema"])

    with client.messages.stream(**kw) as stream:
        partial = "".join(
            ev.delta.partial_json
            for ev in stream
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta"
        )
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert json.loads(partial) == call.input == final.content[-1].input  # type: ignore[union-attr]

    # The result goes back as a tool_result block; the conversation renders and runs on.
    history = [
        *ASK,
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "12:00"},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    answer = client.messages.create(
        model="m", max_tokens=8, messages=history, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "none"}, extra_body=GREEDY,
    )  # fmt: skip
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in answer.content)


def test_named_tool_is_the_one_called(engine: EngineProcess) -> None:
    msg = sdk(engine).messages.create(
        model="m", max_tokens=60, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "tool", "name": "get_time"}, extra_body=GREEDY,
    )  # fmt: skip
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert calls and all(c.name == "get_time" for c in calls), msg
    jsonschema.validate(calls[0].input, TIME_TOOL["input_schema"])


def test_stop_sequences(engine: EngineProcess) -> None:
    client = sdk(engine)
    kw: dict[str, Any] = dict(model="m", max_tokens=24, messages=ASK, extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text  # type: ignore[union-attr]
    stop = text[8:12]
    assert stop.strip(), text
    cut = client.messages.create(**kw, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_claude_code_fields_are_accepted_and_named(raw: httpx.Client) -> None:
    body = {
        "model": "claude-opus-5-5",
        "max_tokens": 4,
        "messages": ASK,
        "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": []},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": json.dumps({"session_id": "s"})},
    }
    headers = {"anthropic-beta": "claude-code-20250219", "anthropic-version": "2023-06-01"}
    r = raw.post("/v1/messages?beta=true", json=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "claude-opus-5-5"
    ignored = r.headers["X-PolyKV-Ignored-Fields"].split(",")
    assert {"thinking", "context_management", "metadata", "output_config.effort"} <= set(ignored)


def test_output_format_is_enforced(engine: EngineProcess) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    msg = sdk(engine).messages.create(
        model="m", max_tokens=40, messages=ASK, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    assert msg.stop_reason == "end_turn", msg
    jsonschema.validate(json.loads(msg.content[0].text), schema)  # type: ignore[union-attr]


def _refused(raw: httpx.Client, body: dict[str, Any], *needles: str) -> dict[str, Any]:
    r = raw.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    for needle in needles:
        assert needle in err["error"]["message"], err
    return dict(err["error"])


def test_errors_take_anthropics_shape_and_name_the_field(
    engine: EngineProcess, raw: httpx.Client
) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk(engine).messages.create(
            model="m", max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )  # fmt: skip
    assert "'image' is not supported" in str(info.value)
    base = {"model": "m", "max_tokens": 4, "messages": ASK}
    _refused(raw, {"model": "m", "messages": ASK}, "max_tokens")
    _refused(raw, {**base, "system": [{"type": "document"}]}, "'document' is not supported")
    search = {"type": "web_search_20250305", "name": "web_search", "input_schema": {}}
    _refused(raw, {**base, "tools": [search]}, "server tool")
    _refused(raw, {**base, "tool_choice": {"type": "any"}}, "needs tools")
    _refused(raw, {**base, "tools": [TIME_TOOL], "tool_choice": {"type": "tool"}}, "name")
    r = raw.post("/v1/messages/nope", json=base)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_bounds_refuse_before_llama_cpp(raw: httpx.Client) -> None:
    base = {"model": "m", "max_tokens": 4, "messages": ASK}
    _refused(raw, {**base, "max_tokens": 2**31}, "max_tokens")
    _refused(raw, {**base, "stop_sequences": ["x"] * 17}, "stop_sequences")
    _refused(raw, {**base, "stop_sequences": ["x"] * 9, "stop": ["y"] * 8}, "at most 16")
    many = [{**TIME_TOOL, "name": f"t{i}"} for i in range(129)]
    _refused(raw, {**base, "tools": many}, "tools")
    blocks = [{"type": "text", "text": "a"}] * 10_001
    _refused(raw, {**base, "messages": [{"role": "user", "content": blocks}]}, "content")
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):  # 80 deep as a schema (limit 64), under the body limit of 128
        deep = {"type": "object", "properties": {"x": deep}}
    tool = {**TIME_TOOL, "input_schema": deep}
    err = _refused(raw, {**base, "tools": [tool]}, "get_time")
    assert err["reason"] == "schema_too_large"
    # The engine still answers.
    assert raw.post("/v1/messages", json={**base, "temperature": 0}).status_code == 200


# ---------------------------------------------------------------------------- keys and 429


@pytest.fixture(scope="module")
def keyed(start_engine: Callable[..., EngineProcess]) -> Iterator[httpx.Client]:
    eng = start_engine(
        "-np", "4", "-c", "8192", "--polykv-admin-key", "admin-key", "--api-key", "infer-key",
    )  # fmt: skip
    with httpx.Client(base_url=eng.base_url, timeout=60) as c:
        yield c


def test_rate_limit_is_429_with_retry_after_and_keys_are_checked(keyed: httpx.Client) -> None:
    prompt = saturated_pool(keyed, "anth-rej")
    base = str(keyed.base_url)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=ASK
        )
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    client = anthropic.Anthropic(base_url=base, api_key="infer-key", max_retries=0)
    with Load(keyed, "anth-rej", prompt, ["anth-bg"]):
        wait_for(settled_and_active(keyed, "anth-rej"))
        with pytest.raises(anthropic.RateLimitError) as refused:
            client.messages.create(
                model="m", max_tokens=4, messages=ASK, extra_body={"pool_id": "anth-rej"},
                extra_headers={"x-session-id": "anth-new"},
            )  # fmt: skip
    err = refused.value
    assert err.status_code == 429 and int(err.response.headers["retry-after"]) >= 1
    assert err.body["type"] == "error"  # type: ignore[index]
    assert err.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert err.body["error"]["reason"] == "tps_floor"  # type: ignore[index]


# ---------------------------------------------------------------------------- agent identity


def test_claude_code_sessions_sub_agents_share_the_prefix_and_final_releases(
    engine: EngineProcess, raw: httpx.Client
) -> None:
    """Claude Code's headers: the run's session, a sub-agent's own session beside it that
    reads the shared system prompt and tools from KV (no pool declared), and a final turn
    that releases what was kept."""
    client = sdk(engine)
    system = "You coordinate a crew of agents; every one of them reads this first. " * 12
    run = "9f0c5c1e-0000-4000-8000-000000000001"
    kw: dict[str, Any] = dict(
        model="m", max_tokens=4, system=system, tools=[WEATHER_TOOL, TIME_TOOL],
        extra_body=GREEDY,
    )  # fmt: skip
    parent = client.messages.create(
        **kw, messages=[{"role": "user", "content": "Plan the trip."}],
        extra_headers={"X-Claude-Code-Session-Id": run},
    ).usage  # fmt: skip
    agent = {"X-Claude-Code-Session-Id": run, "x-claude-code-agent-id": "a1f2"}
    sub = client.messages.create(
        **kw, messages=[{"role": "user", "content": "Check the weather."}], extra_headers=agent
    ).usage
    prompt = parent.input_tokens + (parent.cache_read_input_tokens or 0)
    shared = sub.cache_read_input_tokens or 0
    assert shared >= prompt - 16, (parent, sub)  # all but the parent's own last words
    assert raw.get(f"/polykv/sessions/{run}").json()["session_id"] == run
    assert raw.get(f"/polykv/sessions/{run}:a1f2").status_code == 200

    client.messages.create(
        **kw, messages=[{"role": "user", "content": "Done."}],
        extra_headers={**agent, "x-session-final": "true"},
    )  # fmt: skip
    assert raw.get(f"/polykv/sessions/{run}:a1f2").status_code == 404
    assert raw.get(f"/polykv/sessions/{run}").status_code == 200  # the run goes on
    r = raw.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": ASK},
                 headers={"X-Claude-Code-Session-Id": "bad id"})  # fmt: skip
    assert r.status_code == 400 and "x-claude-code-session-id" in r.json()["error"]["message"]


def test_n_predict_caps_what_an_agent_asks_for(start_engine: Callable[..., EngineProcess]) -> None:
    """Claude Code asks for 128000 tokens; ``-n`` (llama-server's) caps every request."""
    eng = start_engine("-np", "1", "-c", "2048", "-n", "3")
    kw: dict[str, Any] = dict(model="m", max_tokens=128000, messages=ASK, extra_body=GREEDY)
    with sdk(eng).messages.stream(**kw) as stream:  # the SDK streams a request this long
        msg = stream.get_final_message()
    assert msg.usage.output_tokens == 3 and msg.stop_reason == "max_tokens"
    r = httpx.post(f"{eng.base_url}/completion", json={"prompt": "a", "n_predict": 2}, timeout=60)
    assert r.json()["tokens_predicted"] == 2  # under the cap: as asked
