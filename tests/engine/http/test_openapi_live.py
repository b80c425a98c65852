"""Live responses against the committed OpenAPI document: every documented operation that a
request here reaches answers with a body its schema accepts, and every error with ErrorBody."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

DOC = json.loads(
    (Path(__file__).resolve().parents[3] / "engine_image" / "openapi.json").read_text()
)


def check(body: Any, method: str, path: str, status: str = "200") -> None:
    op = DOC["paths"][path][method]
    schema = op["responses"][status]["content"]["application/json"]["schema"]
    jsonschema.validate(body, {**schema, "components": DOC["components"]})


def test_every_operation_has_a_documented_error_body() -> None:
    for path, ops in DOC["paths"].items():
        for method, op in ops.items():
            assert {"400", "404", "500"} <= set(op["responses"]), (method, path)


def test_reason_codes_are_listed() -> None:
    reasons = DOC["components"]["schemas"]["ErrorDetail"]["properties"]["reason"]["enum"]
    assert {"name_conflict", "prefix_mismatch", "tps_floor", "pool_not_found"} <= set(reasons)


@pytest.fixture
def pool(client: httpx.Client) -> str:
    client.post("/polykv/pools", json={"prompt": "openapi root prefix", "name": "oa-root"})
    r = client.post("/polykv/pools/oa-root/fork", json={"prompt": "openapi root prefix and more",
                                                        "name": "oa-child"})  # fmt: skip
    assert r.status_code in (200, 201), r.text
    return "oa-child"


def test_inference_responses_match_the_document(client: httpx.Client, pool: str) -> None:
    r = client.post("/completion", json={"prompt": "hi", "n_predict": 3, "n_probs": 2})
    check(r.json(), "post", "/completion")
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 1})
    check(r.json(), "post", "/v1/completions")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 1, "pool_id": pool}  # fmt: skip
    check(client.post("/v1/chat/completions", json=chat).json(), "post", "/v1/chat/completions")
    tools = {
        **chat,
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "tool_choice": "required",
        "max_tokens": 60,
    }
    r = client.post("/v1/chat/completions", json=tools).json()
    check(r, "post", "/v1/chat/completions")


def test_control_responses_match_the_document(client: httpx.Client, pool: str) -> None:
    check(client.get("/polykv/pools").json(), "get", "/polykv/pools")
    check(client.get(f"/polykv/pools/{pool}").json(), "get", "/polykv/pools/{pool}")
    check(client.get(f"/polykv/pools/{pool}/capacity").json(), "get",
          "/polykv/pools/{pool}/capacity")  # fmt: skip
    check(client.get("/polykv/tps").json(), "get", "/polykv/tps")
    for action in ("pin", "unpin"):
        r = client.post(f"/polykv/pools/{pool}/{action}")
        check(r.json(), "post", f"/polykv/pools/{{pool}}/{action}")
    r = client.post(f"/polykv/pools/{pool}/admission", json={"target_tps_per_session": 1.5})
    check(r.json(), "post", "/polykv/pools/{pool}/admission")
    check(client.delete(f"/polykv/pools/{pool}/admission").json(), "delete",
          "/polykv/pools/{pool}/admission")  # fmt: skip
    r = client.post("/completion", json={"prompt": "x", "n_predict": 1, "session_id": "oa-s"})
    assert r.status_code == 200, r.text
    found = client.get("/polykv/sessions/oa-s")
    assert found.status_code == 200, (r.json(), found.text, client.get("/slots").json())
    check(found.json(), "get", "/polykv/sessions/{session}")
    r = client.post("/polykv/pools", json={"prompt": "openapi other", "name": "oa-other"})
    check(r.json(), "post", "/polykv/pools")
    check(client.delete("/polykv/pools/oa-other").json(), "delete", "/polykv/pools/{pool}")


@pytest.mark.parametrize(
    ("method", "path", "doc_path", "body", "status"),
    [
        ("get", "/polykv/pools/nope", "/polykv/pools/{pool}", None, "404"),
        ("post", "/polykv/pools", "/polykv/pools", {"prompt": "a", "bogus": 1}, "400"),
        ("delete", "/polykv/pools/oa-root", "/polykv/pools/{pool}", None, "409"),
        ("post", "/completion", "/completion", {"prompt": []}, "400"),
        ("get", "/polykv/sessions/nobody", "/polykv/sessions/{session}", None, "404"),
    ],
)
def test_errors_match_the_document(
    client: httpx.Client,
    pool: str,
    method: str,
    path: str,
    doc_path: str,
    body: dict[str, Any] | None,
    status: str,
) -> None:
    r = client.request(method.upper(), path, json=body)
    assert str(r.status_code) == status, r.text
    check(r.json(), method, doc_path, status)
