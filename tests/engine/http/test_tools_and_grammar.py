"""Tool calls, structured output and logprobs through the official openai package, on the
generated model (its template is Hermes-style: <tool_call>{...}</tool_call>).

The model has random weights, so its choices are nonsense; what is checked is the contract:
a grammar makes every constrained output valid, calls come back in OpenAI's shape whole and
streamed, and logprobs are llama.cpp's own log-softmax of the logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from polykv_engine.llama.runtime import LlamaRuntime, RuntimeConfig
from polykv_engine.testing import EngineProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [
    {"role": "system", "content": "You help with travel."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def oai(engine: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused", max_retries=0)


def answered(call: Any, result: str) -> list[dict[str, Any]]:
    """ASK, the assistant's call, and the tool's result: the history of the next turn."""
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]


def check_call(call: Any) -> dict[str, Any]:
    fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    assert call.id and call.type == "function"
    return dict(args)


def test_required_tool_call_whole_and_streamed_agree(engine: EngineProcess) -> None:
    client = oai(engine)
    kw: dict[str, Any] = dict(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0,
    )  # fmt: skip
    # One call: the grammar then allows only the end of the reply, which even random
    # weights reach (with parallel calls they may write blanks until max_tokens).
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    calls = [(c.function.name, check_call(c)) for c in whole.message.tool_calls]
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            if d.function and d.function.name:
                names[d.index] = d.function.name
            args[d.index] = args.get(d.index, "") + ((d.function and d.function.arguments) or "")
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == calls


def test_named_function_and_single_call(engine: EngineProcess) -> None:
    resp = oai(engine).chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    calls = resp.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_time"
    assert check_call(calls[0])["zone"] in ("UTC", "CET")


def test_tool_loop_call_result_answer(engine: EngineProcess) -> None:
    client = oai(engine)
    first = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=120, temperature=0,
    ).choices[0].message  # fmt: skip
    assert first.tool_calls
    call = first.tool_calls[0]
    history = answered(call, "18 C and sunny")
    final = client.chat.completions.create(
        model="m", messages=history, tools=[WEATHER], tool_choice="none",
        max_tokens=16, temperature=0,
    ).choices[0]  # fmt: skip
    assert final.message.tool_calls is None
    assert isinstance(final.message.content, str) and final.finish_reason in ("stop", "length")


def test_a_call_cut_by_max_tokens_replays_without_losing_the_conversation(
    engine: EngineProcess,
) -> None:
    client = oai(engine)
    kw: dict[str, Any] = dict(
        model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0,
    )  # fmt: skip
    whole = client.chat.completions.create(**kw, max_tokens=120)
    assert whole.usage is not None and whole.choices[0].finish_reason == "tool_calls"
    # Cut a few tokens short of the whole call: named, its arguments not closed.
    for short in range(2, 40):
        cut = client.chat.completions.create(
            **kw, max_tokens=whole.usage.completion_tokens - short
        ).choices[0]
        assert cut.finish_reason == "length" and cut.message.tool_calls
        call = cut.message.tool_calls[0]
        if not call.function.arguments.rstrip().endswith("}"):
            break
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # the model's partial JSON, as it wrote it
    history = answered(call, "error: the call was cut short")
    again = client.chat.completions.create(
        model="m", messages=history, tools=[WEATHER], tool_choice="required",
        max_tokens=120, temperature=0,
    ).choices[0]  # fmt: skip
    assert again.message.tool_calls and check_call(again.message.tool_calls[0])["city"]
    prompt = httpx.post(
        f"{engine.base_url}/apply-template", json={"messages": history, "tools": [WEATHER]}
    ).json()["prompt"]
    assert call.function.arguments in prompt  # the model sees what it wrote


def test_a_pool_of_messages_and_tools_is_shared_by_tool_using_agents(
    client: httpx.Client,
) -> None:
    tools = [WEATHER, TIME]
    r = client.post(
        "/polykv/pools", json={"messages": ASK[:1], "tools": tools, "name": "travel-tools"}
    )
    assert r.status_code == 201, r.text
    prefix = r.json()["prefix_len"]
    body = {
        "messages": ASK,
        "tools": list(reversed(tools)),  # any order of keys and tools... of keys at least
        "tool_choice": "auto",
        "pool_id": "travel-tools",
        "max_tokens": 8,
        "temperature": 0,
    }
    body["tools"] = tools
    out = client.post("/v1/chat/completions", json=body)
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix


@pytest.mark.parametrize(
    "fmt",
    [
        {
            "type": "json_schema",
            "json_schema": {
                "name": "person",
                "strict": True,
                "schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 10},
                        "age": {"type": "integer", "minimum": 0, "maximum": 130},
                    },
                    "required": ["name", "age"],
                    "additionalProperties": False,
                },
            },
        },
    ],
)
def test_structured_output_always_parses(engine: EngineProcess, fmt: dict[str, Any]) -> None:
    """Sampled (temperature 1), every reply validates. A schema with bounded strings, so
    the random model's output ends within max_tokens (json_object is tested on the real
    model, which ends its own strings)."""
    client = oai(engine)
    for seed in range(5):
        resp = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Describe someone."}],
            response_format=fmt,  # type: ignore[arg-type]
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        doc = json.loads(resp.choices[0].message.content or "")
        assert isinstance(doc, dict)
        if fmt["type"] == "json_schema":
            jsonschema.validate(doc, fmt["json_schema"]["schema"])


def test_completion_grammar_and_json_schema(client: httpx.Client) -> None:
    r = client.post(
        "/completion",
        json={"prompt": "Pick:", "grammar": 'root ::= "yes" | "no"', "n_predict": 8},
    )
    assert r.status_code == 200 and r.json()["content"] in ("yes", "no")
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}
    r = client.post("/completion", json={"prompt": "Numbers:", "json_schema": schema})
    assert r.status_code == 200
    jsonschema.validate(json.loads(r.json()["content"]), schema)


def test_logprobs_are_llama_cpps_log_softmax(
    engine: EngineProcess, client: httpx.Client, test_model: Path
) -> None:
    prompt = "The quick brown fox"
    r = client.post(
        "/completion",
        json={"prompt": prompt, "n_predict": 1, "temperature": 0, "n_probs": 3},
    ).json()
    (entry,) = r["completion_probabilities"]
    # The same prompt evaluated directly with llama.cpp, no server.
    rt = LlamaRuntime(RuntimeConfig(test_model, n_ctx=256, cache_type_k="f32", cache_type_v="f32"))
    try:
        tokens = rt.tokenize(prompt, add_special=True, parse_special=True)
        batch = rt.new_batch()
        for i, t in enumerate(tokens):
            batch.add(t, i, 0, i == len(tokens) - 1)
        assert rt.decode(batch) == 0
        direct = rt.token_logprobs(len(tokens) - 1, entry["id"], 3)
    finally:
        rt.close()
    assert entry["id"] == direct.top[0][0]  # greedy took the most likely token
    assert math.isclose(entry["logprob"], direct.logprob, abs_tol=2e-3)
    assert [t["id"] for t in entry["top_logprobs"]] == [t for t, _ in direct.top]
    assert sum(math.exp(t["logprob"]) for t in entry["top_logprobs"]) <= 1.0 + 1e-6


def test_logprobs_in_openai_shapes(engine: EngineProcess) -> None:
    client = oai(engine)
    chat = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    ).choices[0]
    assert chat.logprobs is not None and chat.logprobs.content
    assert len(chat.logprobs.content) == 5
    for item in chat.logprobs.content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    streamed = []
    for chunk in client.chat.completions.create(
        model="m", messages=ASK, max_tokens=5, temperature=0, logprobs=True, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content or []
    whole = [t.logprob for t in chat.logprobs.content]
    # The second request reuses the first's cached prompt, so its first token comes from a
    # one-token batch, which rounds differently from a prompt batch.
    assert [t.logprob for t in streamed] == pytest.approx(whole, abs=1e-3)
    legacy = client.completions.create(
        model="m", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2
    ).choices[0]
    assert legacy.logprobs is not None
    assert len(legacy.logprobs.tokens or []) == 4
    assert len(legacy.logprobs.top_logprobs or []) == 4
    assert "".join(legacy.logprobs.tokens or []) == legacy.text


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "generic"])
def test_every_familys_grammars_are_accepted_by_llama_cpp(fmt: str, test_model: Path) -> None:
    from polykv_engine.chat.tools import plan

    rt = LlamaRuntime(RuntimeConfig(test_model, n_ctx=256))
    try:
        for choice in (
            "auto",
            "required",
            "none",
            {"type": "function", "function": {"name": "get_time"}},
        ):
            for parallel in (True, False):
                p = plan(fmt, [WEATHER, TIME], choice, parallel)  # type: ignore[arg-type]
                assert p is not None
                if p.grammar is not None:
                    rt.compile_grammar(p.grammar)
    finally:
        rt.close()
