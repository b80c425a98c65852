"""The engine's OpenAPI document, generated from the wire contract (never written by hand).

``python -m polykv_api.openapi > engine_image/openapi.json``; a test fails when the committed
file and the models disagree.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import anthropic as a
from . import models as m
from . import openai_responses as r

Op = tuple[str, str, str, type[BaseModel] | None, type[BaseModel] | None]

# (method, path, summary, request model, response model)
OPERATIONS: list[Op] = [
    (
        "post",
        "/completion",
        "llama-server native completion",
        m.CompletionRequest,
        m.NativeCompletion,
    ),
    ("post", "/v1/completions", "OpenAI completions", m.OAICompletionRequest, m.TextCompletion),
    (
        "post",
        "/v1/chat/completions",
        "OpenAI chat completions (tools, response_format, logprobs)",
        m.ChatCompletionRequest,
        m.ChatCompletion,
    ),
    (
        "post",
        "/v1/messages",
        "Anthropic Messages (tools, streaming; errors in Anthropic's shape)",
        a.MessagesRequest,
        a.MessageResponse,
    ),
    (
        "post",
        "/v1/messages/count_tokens",
        "The prompt's length as /v1/messages renders it",
        a.CountTokensRequest,
        a.TokenCount,
    ),
    (
        "post",
        "/v1/responses",
        "OpenAI Responses for function-calling agents (previous_response_id, streaming)",
        r.ResponsesRequest,
        r.ResponseObject,
    ),
    ("post", "/apply-template", "The chat template applied", m.ApplyTemplateRequest, None),
    ("post", "/tokenize", "Text to tokens", m.TokenizeRequest, None),
    ("post", "/detokenize", "Tokens to text", m.DetokenizeRequest, None),
    ("get", "/polykv/tps", "Per-session and aggregate decode tps", None, m.TpsSnapshot),
    ("get", "/polykv/sessions/{session}", "Where a session lives", None, m.SessionInfo),
    ("post", "/polykv/pools", "Create a root pool", m.PoolCreateRequest, m.PoolCreated),
    ("get", "/polykv/pools", "The pool tree with KV accounting", None, m.PoolList),
    ("get", "/polykv/pools/{pool}", "One pool and its descendants", None, m.PoolDetail),
    ("delete", "/polykv/pools/{pool}", "Release a pool (leaves first)", None, m.PoolReleased),
    (
        "post",
        "/polykv/pools/{pool}/fork",
        "Extend or branch a pool",
        m.PoolForkRequest,
        m.PoolCreated,
    ),
    ("post", "/polykv/pools/{pool}/pin", "Pin a pool", None, m.PoolStatus),
    ("post", "/polykv/pools/{pool}/unpin", "Unpin a pool", None, m.PoolStatus),
    ("post", "/polykv/pools/{pool}/evict", "Drop a pool's KV, keep the pool", None, m.PoolStatus),
    ("post", "/polykv/pools/{pool}/flush", "Evict a pool's subtree", None, m.PoolStatus),
    (
        "post",
        "/polykv/pools/{pool}/admission",
        "Set the admission policy",
        m.AdmissionPolicy,
        m.PoolStatus,
    ),
    ("delete", "/polykv/pools/{pool}/admission", "Clear the admission policy", None, m.PoolStatus),
    ("get", "/polykv/pools/{pool}/capacity", "Admission verdict", None, m.CapacityReport),
    (
        "get",
        "/polykv/snapshots/{digest}",
        "A stored KV snapshot file, streamed (peer replicas fetch pools' cells with it)",
        None,
        None,
    ),
]

ERROR = {"$ref": "#/components/schemas/ErrorBody"}
ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicError"}
STRING = {"type": "string"}
ERRORS = {
    "400": "invalid request",
    "401": "no or wrong key",
    "403": "an inference key on an admin route",
    "404": "no such pool, session or route",
    "409": "conflicts with the pool tree",
    "413": "body too large",
    "415": "not application/json",
    "429": "admission refused a new session",
    "500": "the engine's own fault",
    "501": "not supported by this engine",
    "503": "loading, shutting down, or out of KV",
}


PATH_PARAMETERS: dict[str, tuple[str, dict[str, str]]] = {
    "session": ("the session id (x-session-id)", STRING),
    "pool": ("pool id (per replica) or pool name", STRING),
    "digest": (
        "the snapshot's key digest: 64 lowercase hex characters",
        {"type": "string", "pattern": "^[0-9a-f]{64}$"},
    ),
}


def document() -> dict[str, Any]:
    models = {op[3] for op in OPERATIONS} | {op[4] for op in OPERATIONS}
    models |= {m.ErrorBody, a.AnthropicError}
    used = sorted((x for x in models if x is not None), key=lambda x: x.__name__)
    _, schemas = models_json_schema(
        [(x, "validation") for x in used], ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, req, resp in OPERATIONS:
        op: dict[str, Any] = {"summary": summary, "responses": {}}
        for name, (description, schema) in PATH_PARAMETERS.items():
            if f"{{{name}}}" in path:
                op["parameters"] = [
                    {
                        "name": name,
                        "in": "path",
                        "required": True,
                        "description": description,
                        "schema": schema,
                    }
                ]
        if "{digest}" in path:
            op["responses"]["200"] = {
                "description": "the file (its header carries the payload's sha256)",
                "content": {"application/octet-stream": {"schema": STRING}},
            }
        if req is not None:
            ref = {"$ref": f"#/components/schemas/{req.__name__}"}
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
        ok: dict[str, Any] = op["responses"].get("200", {"description": "OK"})
        if resp is not None:
            ok["content"] = {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{resp.__name__}"}}
            }
        op["responses"]["200"] = ok
        if resp is m.PoolList:  # pollers revalidate instead of parsing an unchanged listing
            ok["headers"] = {"ETag": {"description": "over the body", "schema": STRING}}
            op["parameters"] = [
                {
                    "name": "If-None-Match",
                    "in": "header",
                    "required": False,
                    "description": "an ETag from an earlier answer",
                    "schema": STRING,
                }
            ]
            op["responses"]["304"] = {
                "description": "Not Modified: the listing is byte-identical to that ETag's",
                "headers": ok["headers"],
            }
        if resp is m.PoolCreated:  # a new pool is 201; an existing one of that name is 200
            op["responses"]["201"] = {**ok, "description": "Created"}
        anthropic_route = path.startswith("/v1/messages")
        for code, why in ERRORS.items():
            op["responses"][code] = {
                "description": f"{why}; `error.reason` says which (see ErrorDetail.reason)",
                "content": {
                    "application/json": {"schema": ANTHROPIC_ERROR if anthropic_route else ERROR}
                },
            }
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "PolyKV engine", "version": "v1"},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
