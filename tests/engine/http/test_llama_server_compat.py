"""llama-server's documented requests, replayed against the engine: the response fields its
README promises are there with the same meaning, so a client written for llama-server (or a
dashboard reading its metrics) keeps working when the image is swapped for PolyKV's."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

DOC_PROMPT = "Building a website can be done in 10 simple steps:"


def test_health(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/health").json() == {"status": "ok"}


def test_completion_documented_fields(client: httpx.Client) -> None:
    r = client.post("/completion", json={"prompt": DOC_PROMPT, "n_predict": 16})
    body = r.json()
    for field in ("content", "tokens", "stop", "generation_settings", "model", "stop_type",
                  "stopping_word", "timings", "tokens_cached", "tokens_evaluated",
                  "tokens_predicted", "truncated", "id_slot"):  # fmt: skip
        assert field in body, field
    assert body["stop"] is True and body["stop_type"] in ("eos", "limit", "word")
    for field in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                  "predicted_per_second", "cache_n"):  # fmt: skip
        assert field in body["timings"], field


def test_max_tokens_and_max_completion_tokens_are_n_predict(client: httpx.Client) -> None:
    """An old curl script: {"prompt": ..., "max_tokens": 5} generates 5 tokens, stop_type
    limit (it once generated until the context was full)."""
    for alias in ("max_tokens", "max_completion_tokens"):
        r = client.post(
            "/completion",
            json={"prompt": "The quick brown fox", alias: 5, "ignore_eos": True},
        ).json()
        assert r["tokens_predicted"] == 5 and r["stop_type"] == "limit", alias
    both = client.post(
        "/completion",
        json={"prompt": "The quick brown fox", "n_predict": 3, "max_tokens": 9, "ignore_eos": True},
    ).json()
    assert both["tokens_predicted"] == 3  # n_predict wins, as in llama-server


def test_completion_streaming_documented_chunks(client: httpx.Client) -> None:
    with client.stream(
        "POST", "/completion", json={"prompt": DOC_PROMPT, "n_predict": 8, "stream": True}
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for ev in events[:-1]:
        assert {"content", "tokens", "stop"} <= set(ev) and ev["stop"] is False
    assert events[-1]["stop"] is True and "timings" in events[-1]


def test_n_probs_documented_shape(client: httpx.Client) -> None:
    r = client.post("/completion", json={"prompt": DOC_PROMPT, "n_predict": 2, "n_probs": 2})
    probs = r.json()["completion_probabilities"]
    assert len(probs) == 2
    for p in probs:
        assert {"id", "logprob", "token", "bytes", "top_logprobs"} <= set(p)
        assert len(p["top_logprobs"]) == 2
        assert {"id", "logprob", "token", "bytes"} <= set(p["top_logprobs"][0])


def test_tokenize_detokenize_documented(client: httpx.Client) -> None:
    ids = client.post("/tokenize", json={"content": "Hello world!"}).json()["tokens"]
    assert all(isinstance(i, int) for i in ids)
    pieces = client.post("/tokenize", json={"content": "Hello world!", "with_pieces": True}).json()[
        "tokens"
    ]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces)
    assert client.post("/detokenize", json={"tokens": ids}).json()["content"] == "Hello world!"
    odd = client.post("/tokenize", json={"content": "á", "with_pieces": True}).json()["tokens"]
    for p in odd:  # a piece that is not valid UTF-8 on its own comes back as bytes
        assert isinstance(p["piece"], (str, list))


def test_apply_template(client: httpx.Client) -> None:
    r = client.post("/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and "Hi" in r.json()["prompt"]


def test_props_documented_fields(client: httpx.Client) -> None:
    props = client.get("/props").json()
    for field in ("default_generation_settings", "total_slots", "model_path", "chat_template",
                  "modalities", "build_info"):  # fmt: skip
        assert field in props, field
    assert props["default_generation_settings"]["n_ctx"] > 0


def test_slots_documented_shape(client: httpx.Client) -> None:
    client.post("/completion", json={"prompt": DOC_PROMPT, "n_predict": 4, "id_slot": 0})
    slot = client.get("/slots").json()[0]
    for field in ("id", "id_task", "n_ctx", "speculative", "is_processing", "params",
                  "next_token", "n_prompt_tokens", "n_prompt_tokens_cache"):  # fmt: skip
        assert field in slot, field
    assert isinstance(slot["next_token"], list)
    assert {"has_next_token", "has_new_line", "n_remain", "n_decoded"} <= set(slot["next_token"][0])
    assert slot["n_prompt_tokens"] > 0 and slot["params"]["n_predict"] == 4
    for field in ("temperature", "top_k", "top_p", "min_p", "seed", "stop"):
        assert field in slot["params"], field


def test_v1_models_documented_shape(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    model = body["data"][0]
    assert model["object"] == "model"
    assert {"n_vocab", "n_ctx_train", "n_embd", "n_params", "size"} <= set(model["meta"])


def test_metrics_serve_llama_servers_series(client: httpx.Client) -> None:
    client.post("/completion", json={"prompt": DOC_PROMPT, "n_predict": 4})
    fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("llamacpp:prompt_tokens", "llamacpp:prompt_seconds", "llamacpp:tokens_predicted",
                 "llamacpp:tokens_predicted_seconds", "llamacpp:n_decode",
                 "llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds",
                 "llamacpp:requests_processing", "llamacpp:requests_deferred",
                 "llamacpp:n_busy_slots_per_decode", "llamacpp:n_tokens_max"):  # fmt: skip
        assert name in fams, name
    samples = {s.name: s.value for f in fams.values() for s in f.samples}
    assert samples["llamacpp:tokens_predicted_total"] >= 4
    assert samples["llamacpp:n_decode_total"] >= 1
    assert samples["llamacpp:n_busy_slots_per_decode"] >= 1


def test_response_format_schema_shorthand(client: httpx.Client) -> None:
    """llama-server's {"type": "json_object", "schema": {...}} shorthand."""
    body = {
        "messages": [{"role": "user", "content": "a word"}],
        "response_format": {"type": "json_object", "schema": {"type": "string", "maxLength": 8}},
        "max_tokens": 40,
        "temperature": 0,
    }
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert isinstance(json.loads(content["content"]), str)
