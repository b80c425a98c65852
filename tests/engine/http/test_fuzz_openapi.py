"""Schema-driven fuzzing of the engine against its own OpenAPI document (schemathesis):
bodies generated from the request schemas, valid and invalid. Every answer is below 500,
declared for its operation, and matches the documented schema; afterwards the engine is
alive and its pool tree intact (Σ owned KV == KV in use, and llama.cpp agrees)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from polykv_api.limits import INT32_MAX
from polykv_engine.testing import EngineProcess

DOC = Path(__file__).resolve().parents[3] / "engine_image" / "openapi.json"
LENGTH_FIELDS = ("n_predict", "max_tokens", "max_completion_tokens", "max_output_tokens")

pytestmark = pytest.mark.slow


# The length field each generating route reads; without one a prompt may decode up to the
# context (minutes on a loaded 2-core machine, past the call's timeout).
DEFAULT_LENGTH = {
    "/completion": "n_predict",
    "/completions": "n_predict",
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/v1/messages": "max_tokens",
    "/v1/responses": "max_output_tokens",
}


def tame(body: Any, path: str) -> None:
    """Generated lengths can ask for millions of tokens: cap them so a run stays short. A
    length past the schema's maximum is left as it is: that is negative data to be refused."""
    if isinstance(body, dict):
        for field in LENGTH_FIELDS:
            # null means "no limit" as much as an absent field does
            value = body.get(field, 0)
            if field in body and (
                value is None or (isinstance(value, int) and 4 < value <= INT32_MAX)
            ):
                body[field] = 4
        if path in DEFAULT_LENGTH and not any(f in body for f in LENGTH_FIELDS):
            body[DEFAULT_LENGTH[path]] = 4
        body.pop("stream", None)


def _fuzz_one(
    op: Any, engine: EngineProcess, mode: GenerationMode, examples: int, seen: dict[str, int]
) -> None:
    label = op.label

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        tame(case.body, op.path)
        resp = case.call(base_url=engine.base_url, timeout=60)
        status = resp.status_code
        seen[f"{label} {status}"] = seen.get(f"{label} {status}", 0) + 1
        assert status < 500 or status == 501, f"{label}: {status} {resp.text[:300]}"
        if status == 413:  # the body limit, a bound past the schema's: a refusal either way
            assert resp.json()["error"]["reason"] == "body_too_large", resp.text[:300]
            return
        # Cross-field rules (exactly one prefix source, tools with messages, ...) are not
        # expressible in the schema: "schema-valid" bodies may rightly get a 400.
        case.validate_response(resp, excluded_checks=[positive_data_acceptance])

    run()


def fuzz(engine: EngineProcess, mode: GenerationMode, examples: int) -> dict[str, int]:
    schema = schemathesis.openapi.from_path(str(DOC))
    seen: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        try:
            _fuzz_one(op, engine, mode, examples, seen)
        except Unsatisfiable:
            # An operation with nothing to get wrong (no body, no parameters) has no
            # negative cases to generate.
            assert mode == GenerationMode.NEGATIVE, op.label
    return seen


@pytest.fixture
def fuzzed(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    eng = start_engine("-np", "2", "-c", "4096", "--polykv-kv-debug", "--polykv-max-pools", "8")
    with httpx.Client(base_url=eng.base_url, timeout=60) as c:
        assert c.post("/polykv/pools", json={"prompt": "a root", "name": "keep"}).status_code == 201
    return eng


def check_intact(engine: EngineProcess) -> None:
    with httpx.Client(base_url=engine.base_url, timeout=60) as c:
        assert c.get("/health").json() == {"status": "ok"}
        listing = c.get("/polykv/pools").json()
        owned = sum(p["own_kv_bytes"] for p in listing["pools"])
        owned += sum(s["marginal_kv_bytes"] for p in listing["pools"] for s in p["sessions"])
        owned += sum(s["marginal_kv_bytes"] for s in listing["unpooled_sessions"])
        assert owned == listing["kv_bytes_used"]
        # llama.cpp's own count needs a free cell for its probe token; a full cache has none.
        measured = listing["kv_cells_measured"]
        full = listing["kv_cells_used"] == listing["kv_cells_total"]
        assert measured == listing["kv_cells_used"] or (measured is None and full)
        r = c.post("/completion", json={"prompt": "still fine", "n_predict": 2})
        assert r.status_code == 200


def test_valid_bodies_never_break_the_engine(fuzzed: EngineProcess) -> None:
    seen = fuzz(fuzzed, GenerationMode.POSITIVE, examples=15)
    assert any(k.endswith(" 200") or k.endswith(" 201") for k in seen), seen
    check_intact(fuzzed)


def test_invalid_bodies_are_refused_with_4xx(fuzzed: EngineProcess) -> None:
    seen = fuzz(fuzzed, GenerationMode.NEGATIVE, examples=15)
    assert any(" 4" in k for k in seen), seen
    check_intact(fuzzed)
