from pathlib import Path

from polykv_api.openapi import render

COMMITTED = Path(__file__).resolve().parents[3] / "engine_image" / "openapi.json"


def test_committed_openapi_matches_the_wire_contract() -> None:
    assert COMMITTED.read_text() == render(), (
        "engine_image/openapi.json is stale: run "
        "`.venv/bin/python -m polykv_api.openapi > engine_image/openapi.json`"
    )
