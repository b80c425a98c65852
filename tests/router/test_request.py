"""What the router reads from a request, and what it refuses before routing (pure)."""

from __future__ import annotations

import json

import pytest

from polykv_router.config import parse
from polykv_router.errors import Refusal, engine_reason, fleet_refusal, retry_after_s
from polykv_router.request import RequestError, RoutingKey, routing_key


def body(**fields: object) -> bytes:
    return json.dumps({"messages": [], **fields}).encode()


def test_session_from_the_body_wins_over_the_header() -> None:
    assert routing_key("h", body(session_id="b")) == RoutingKey("b", None)
    assert routing_key("h", body()) == RoutingKey("h", None)
    assert routing_key(None, body(session_id=None)) == RoutingKey(None, None)
    assert routing_key("", body()) == RoutingKey(None, None)  # an empty header: one-shot


def test_prompt_cache_key_keys_a_session_and_the_parent_is_kept() -> None:
    assert routing_key(None, body(prompt_cache_key="pck")) == RoutingKey("pck", None)
    assert routing_key("h", body(prompt_cache_key="pck")).session == "h"
    assert routing_key("c", body(), parent="p") == RoutingKey("c", None, "p")


def test_pool_by_name_id_or_legacy_alias() -> None:
    assert routing_key(None, body(pool_id="crew")).pool == "crew"
    assert routing_key(None, body(pool_id=3)).pool == "3"
    assert routing_key(None, body(shared_pool_slot=2)).pool == "2"
    assert routing_key(None, body(pool_id="crew", shared_pool_slot=2)).pool == "crew"


@pytest.mark.parametrize(
    ("header", "raw", "reason", "names"),
    [
        ("x" * 257, body(), "invalid_request", "x-session-id"),
        (None, body(session_id="y" * 257), "invalid_request", "session_id"),
        (None, body(session_id=""), "invalid_request", "session_id"),
        (None, body(session_id=7), "invalid_request", "session_id"),
        (None, body(pool_id=True), "invalid_request", "pool_id"),
        (None, body(pool_id=""), "invalid_request", "pool_id"),
        (None, body(pool_id=["crew"]), "invalid_request", "pool_id"),
        (None, body(shared_pool_slot=-1), "invalid_request", "shared_pool_slot"),
        (None, body(shared_pool_slot="1"), "invalid_request", "shared_pool_slot"),
        (None, b"{not json", "invalid_json", "JSON"),
        (None, b"\xff\xfe", "invalid_json", "JSON"),
        (None, b"[1, 2]", "invalid_request", "JSON object"),
        (None, b"", "invalid_json", "JSON"),
    ],
)
def test_malformed_routing_fields_are_refused_with_400(
    header: str | None, raw: bytes, reason: str, names: str
) -> None:
    with pytest.raises(RequestError) as info:
        routing_key(header, raw)
    assert info.value.status == 400
    assert info.value.reason == reason
    assert names in info.value.message


def test_a_session_id_of_exactly_256_characters_is_accepted() -> None:
    assert routing_key("x" * 256, body()).session == "x" * 256
    assert routing_key(None, body(session_id="y" * 256)).session == "y" * 256


def test_engine_error_bodies_and_retry_after_are_read_leniently() -> None:
    raw = json.dumps({"error": {"code": 429, "reason": "tps_floor"}}).encode()
    assert engine_reason(raw) == "tps_floor"
    assert engine_reason(b"<html>") is None
    assert engine_reason(b'{"error": "x"}') is None
    assert retry_after_s("7") == 7
    assert retry_after_s(" 3 ") == 3
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after_s(None) is None


def test_the_fleet_429_carries_the_smallest_retry_after_and_its_reason() -> None:
    refusals = [
        Refusal("a", 429, "tps_floor", 7),
        Refusal("b", 429, "kv_headroom", 3),
        Refusal("c", 503, "shutting_down", 1),
        Refusal("d", 429, "tps_floor", 5),
    ]
    status, doc, retry = fleet_refusal("crew", refusals)
    assert (status, retry) == (429, 3)
    assert doc["error"]["reason"] == "kv_headroom"
    assert doc["error"]["code"] == 429 and doc["error"]["type"] == "rate_limit_error"
    assert doc["error"]["pool"] == "crew"
    # Why, and how often; never which replicas were tried (their names are the fleet's).
    assert "2 tps_floor" in doc["error"]["message"]


def test_a_fleet_refusal_names_no_replica() -> None:
    pods = ["eng-7d9f-abcde", "eng-7d9f-fghij"]
    for status, reason in ((429, "tps_floor"), (503, "shutting_down")):
        refusals = [Refusal(p, status, reason, 2) for p in pods]
        _, doc, _ = fleet_refusal("crew", refusals)
        assert not any(p in json.dumps(doc) for p in pods), doc


def test_only_unavailable_replicas_make_a_503() -> None:
    status, doc, retry = fleet_refusal(None, [Refusal("a", 503, "unreachable", None)])
    assert (status, retry) == (503, 1)
    assert doc["error"]["reason"] == "no_replica"


def test_settings_parse_and_refuse_contradictions(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse(["--replica", "a=127.0.0.1:8081", "--poll-interval-ms", "250"], {})
    assert cfg.static[0].port == 8081 and cfg.poll_interval_s == 0.25
    assert cfg.capacity_max_age_s == 1.0
    env = {"POD_NAMESPACE": "agents", "POLYKV_ROUTER_ENGINE_API_KEY": "k"}
    cfg = parse(["--selector", "polykv.io/engine=eng"], env)
    assert (cfg.namespace, cfg.engine_api_key) == ("agents", "k")
    for argv in (
        [],
        ["--selector", "x=y", "--replica", "a=h:1"],
        ["--replica", "a=h:1", "--replica", "a=h:2"],
        ["--replica", "a"],
        ["--replica", "a=h:1", "--max-attempts", "0"],
    ):
        with pytest.raises(SystemExit):
            parse(argv, {})
