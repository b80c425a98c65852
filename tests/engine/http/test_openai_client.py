"""The official openai package, pointed at the engine, works unchanged."""

from __future__ import annotations

import openai

from polykv_engine.testing import EngineProcess


def _client(engine: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused", max_retries=0)


def test_chat_completion(engine: EngineProcess) -> None:
    resp = _client(engine).chat.completions.create(
        model="polykv",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something."},
        ],
        max_tokens=12,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.completion_tokens <= 12


def test_chat_streaming(engine: EngineProcess) -> None:
    client = _client(engine)
    kwargs = dict(
        model="polykv",
        messages=[{"role": "user", "content": "Stream please."}],
        max_tokens=16,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content  # type: ignore[call-overload]
    text = ""
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text == whole
    assert finish in ("stop", "length")


def test_legacy_completions(engine: EngineProcess) -> None:
    client = _client(engine)
    resp = client.completions.create(
        model="polykv", prompt="Once upon", max_tokens=8, temperature=0
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="polykv", prompt="Once upon", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == resp.choices[0].text


def test_models_list(engine: EngineProcess) -> None:
    models = _client(engine).models.list()
    assert len(models.data) == 1
