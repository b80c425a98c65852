"""Bad input gets a precise 4xx in llama-server's error shape, and nothing breaks after it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess

from .conftest import greedy


def assert_error(r: httpx.Response, status: int, type_: str, *needles: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == type_
    for needle in needles:
        assert needle in err["message"], err["message"]


@pytest.mark.parametrize(
    ("path", "body", "needles"),
    [
        ("/completion", b"{not json", ["not valid JSON"]),
        ("/completion", b"[1, 2]", ["JSON object"]),
        ("/completion", b"", ["empty"]),
        ("/completion", {"prompt": "x", "temperature": "hot"}, ["temperature"]),
        ("/completion", {"prompt": "x", "n_predict": -5}, ["n_predict"]),
        ("/completion", {"prompt": "x", "top_p": 1.5}, ["top_p"]),
        ("/completion", {"prompt": "x", "stop": [""]}, ["stop"]),
        ("/completion", {"n_predict": 3}, ["prompt"]),
        ("/completion", {"prompt": []}, ["prompt"]),
        ("/completion", {"prompt": [1, 2, 99999999]}, ["outside the vocabulary"]),
        ("/completion", {"prompt": "x", "session_id": ""}, ["session_id"]),
        # Strict types: JSON true is not 1, "4" is not 4, 1 is not true.
        ("/completion", {"prompt": [True, 2]}, ["prompt"]),
        ("/completion", {"prompt": "x", "n_predict": "4"}, ["n_predict"]),
        ("/completion", {"prompt": "x", "n_predict": True}, ["n_predict"]),
        ("/completion", {"prompt": "x", "stream": 1}, ["stream"]),
        ("/completion", {"prompt": "x", "temperature": False}, ["temperature"]),
        ("/detokenize", {"tokens": [True]}, ["tokens"]),
        ("/polykv/pools", {"tokens": [1, False]}, ["tokens"]),
        ("/v1/completions", {"prompt": ["a", "b"]}, ["one prompt"]),
        ("/v1/completions", {"prompt": "a", "n": 2}, ["n"]),
        ("/v1/chat/completions", {"messages": []}, ["messages"]),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, ["role"]),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            ["text content"],
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "xml"},
            },
            ["response_format"],
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema"},
            },
            ["json_schema"],
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            ["tool_choice", "'g'"],
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"description": "no name"}}],
            },
            ["tools"],
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            ["needs tools"],
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
            ["top_logprobs"],
        ),
        ("/completion", {"prompt": "x", "grammar": "root ::= nothing-defined"}, ["grammar"]),
        ("/completion", {"prompt": "x", "grammar": "a", "json_schema": {}}, ["not both"]),
        ("/completion", {"prompt": "x", "n_probs": 99}, ["n_probs"]),
        ("/tokenize", {"content": 5}, ["content"]),
        ("/detokenize", {"tokens": [-1]}, ["tokens"]),
        ("/detokenize", {"tokens": [10**9]}, ["outside the vocabulary"]),
    ],
)
def test_invalid_requests_are_400(
    client: httpx.Client, path: str, body: bytes | dict[str, object], needles: list[str]
) -> None:
    r = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert_error(r, 400, "invalid_request_error", *needles)
    assert client.post("/completion", json=greedy("ok", n=2)).status_code == 200


def test_prompt_longer_than_the_context(client: httpx.Client) -> None:
    n_ctx = client.get("/props").json()["default_generation_settings"]["n_ctx"]
    r = client.post("/completion", json={"prompt": [1] * (n_ctx + 5), "n_predict": 1})
    assert_error(r, 400, "exceed_context_size_error", "context")
    assert r.json()["error"]["n_ctx"] == n_ctx
    assert client.post("/completion", json=greedy("ok", n=2)).status_code == 200


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert_error(client.get("/nope"), 404, "not_found_error", "/nope")
    assert_error(client.get("/completion"), 405, "invalid_request_error")


def test_body_too_large_is_413(client: httpx.Client) -> None:
    r = client.post("/completion", content=b"x" * (33 * 1024 * 1024))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413


def test_unknown_fields_are_reported_not_silently_dropped(client: httpx.Client) -> None:
    r = client.post("/completion", json=greedy("x", n=2, frobnicate=1, zeta=True))
    assert r.status_code == 200
    assert r.headers["X-PolyKV-Ignored-Fields"] == "frobnicate,zeta"


def test_api_key_is_required_except_on_health_and_metrics(
    start_engine: Callable[..., EngineProcess],
) -> None:
    eng = start_engine("--api-key", "sekret", "--metrics")
    with httpx.Client(base_url=eng.base_url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert_error(c.post("/completion", json=greedy("x", n=1)), 401, "authentication_error")
        assert_error(
            c.post("/completion", json=greedy("x", n=1), headers={"Authorization": "Bearer nope"}),
            401,
            "authentication_error",
        )
        assert_error(c.get("/slots"), 401, "authentication_error")
        ok = c.post(
            "/completion", json=greedy("x", n=1), headers={"Authorization": "Bearer sekret"}
        )
        assert ok.status_code == 200
        assert c.get("/props", headers={"X-Api-Key": "sekret"}).status_code == 200


def test_metrics_disabled_is_501(start_engine: Callable[..., EngineProcess]) -> None:
    eng = start_engine()
    r = httpx.get(f"{eng.base_url}/metrics")
    assert_error(r, 501, "not_supported_error", "--metrics")


def test_bad_tps_interval(client: httpx.Client) -> None:
    r = client.get("/polykv/tps?interval_ms=5", headers={"Accept": "text/event-stream"})
    assert_error(r, 400, "invalid_request_error", "interval_ms")


def test_admin_key_from_file_and_environment(
    start_engine: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    key_file = tmp_path / "admin.keys"
    key_file.write_text("from-file\n")
    eng = start_engine("--api-key", "infer", "--polykv-admin-key-file", str(key_file))
    with httpx.Client(base_url=eng.base_url, timeout=30) as c:
        body = {"prompt": "a pool"}
        assert c.post("/polykv/pools", json=body, headers={"X-Api-Key": "infer"}).status_code == 403
        r = c.post("/polykv/pools", json=body, headers={"X-Api-Key": "from-file"})
        assert r.status_code == 201, r.text


def test_admin_key_alone_leaves_inference_open_and_pools_guarded(
    start_engine: Callable[..., EngineProcess],
) -> None:
    """A PolyKVEngine without apiKeySecretRef: agents need no key, pool management does."""
    eng = start_engine("--polykv-admin-key", "admin-only")
    with httpx.Client(base_url=eng.base_url, timeout=30) as c:
        assert c.post("/completion", json=greedy("x", n=1)).status_code == 200
        assert c.get("/polykv/pools").status_code == 200
        assert_error(c.post("/polykv/pools", json={"prompt": "p"}), 401, "authentication_error")
        assert_error(c.post("/slots/0?action=erase"), 401, "authentication_error")
        ok = c.post("/polykv/pools", json={"prompt": "p"}, headers={"X-Api-Key": "admin-only"})
        assert ok.status_code == 201, ok.text


JSON_ROUTES = ["/completion", "/v1/completions", "/v1/chat/completions", "/tokenize",
               "/detokenize", "/polykv/pools"]  # fmt: skip


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_json_is_415(client: httpx.Client, path: str, ctype: str) -> None:
    r = client.post(path, content=b'{"prompt": "x"}', headers={"Content-Type": ctype})
    assert_error(r, 415, "invalid_request_error", ctype, "application/json")
    assert r.json()["error"]["reason"] == "unsupported_media_type"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/polykv/pools", {"prompt": "a", "nmae": "typo"}, "nmae"),
        ("/polykv/pools/strict-root/fork", {"prompt": "a b", "branchpos": 1}, "branchpos"),
        ("/polykv/pools/strict-root/admission", {"target_tps_per_session": 5, "mod": "x"}, "mod"),
        ("/tokenize", {"content": "a", "add_bos": True}, "add_bos"),
        ("/detokenize", {"tokens": [1], "special": True}, "special"),
    ],
)
def test_control_routes_refuse_unknown_fields_and_change_nothing(
    client: httpx.Client, path: str, body: dict[str, object], field: str
) -> None:
    client.post("/polykv/pools", json={"prompt": "strict root", "name": "strict-root"})
    before = client.get("/polykv/pools").json()["pools"]
    r = client.post(path, json=body)
    assert_error(r, 400, "invalid_request_error", field)
    assert r.json()["error"]["reason"] == "unknown_fields"
    after = client.get("/polykv/pools").json()["pools"]

    def declared(pools: list[dict[str, Any]]) -> list[tuple[str, object]]:
        # Other tests' kept prefixes on the shared engine may reach their TTL meanwhile.
        return [(p["name"], p["admission"]) for p in pools if p["kept_until"] is None]

    assert declared(after) == declared(before)


def test_client_text_never_reaches_a_header_raw(client: httpx.Client) -> None:
    """Found by fuzzing: an unknown field named with a control character used to be echoed
    into X-PolyKV-Ignored-Fields and crash the response (header injection guard)."""
    r = client.post("/completion", json={"\x1c\nX-Evil: 1": 1, "prompt": "x", "n_predict": 1})
    assert r.status_code == 200
    assert r.headers[IGNORED] == "%1C%0AX-Evil%3A%201" and "X-Evil" not in r.headers
    for bad in ("a\nb", "tab\there", "with space", "é", "x" * 257):
        r = client.post("/completion", json={"prompt": "x", "n_predict": 1, "session_id": bad})
        assert_error(r, 400, "invalid_request_error", "session_id")


IGNORED = "X-PolyKV-Ignored-Fields"
