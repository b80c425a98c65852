"""A sliding-window model (Gemma 3, llama.cpp's iSWA cache): served, pools refused at boot
with the reason, and prompt caching that never reuses a prefix whose window was recycled."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from polykv_engine.testing import EngineProcess

pytestmark = pytest.mark.real_model

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, sold and read across Europe. "
)


def test_pools_are_refused_with_the_reason_and_text_is_served(gemma3: Path, tmp_path: Path) -> None:
    eng = EngineProcess(gemma3, ["-np", "2", "-c", "4096"], log_path=tmp_path / "e.log")
    eng.start(timeout=180)
    try:
        with httpx.Client(base_url=eng.base_url, timeout=120) as api:
            r = api.post("/polykv/pools", json={"prompt": TEXT, "name": "g"})
            assert r.status_code == 501
            err = r.json()["error"]
            assert err["reason"] == "pools_disabled" and "sliding-window" in err["message"]
            r = api.post("/completion", json={"prompt": TEXT, "n_predict": 8, "temperature": 0})
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 8
            attach = {"prompt": TEXT, "n_predict": 4, "pool_id": "g"}
            assert api.post("/completion", json=attach).json()["error"]["reason"] in (
                "pools_disabled",
                "pool_not_found",
            )
        assert "pools disabled: this model uses sliding-window attention" in eng.log_tail(200)
    finally:
        eng.stop()


def test_a_recycled_window_is_never_reused(gemma3: Path, tmp_path: Path) -> None:
    # One slot and no pools: the SWA cache holds 1024 cells for a 2048-token context, so a
    # long first turn wraps around and recycles the cells of its earliest positions.
    args = ["-np", "1", "-c", "2048", "--polykv-max-pools", "0", "-ctk", "f32", "-ctv", "f32"]
    eng = EngineProcess(gemma3, args, log_path=tmp_path / "e.log")
    eng.start(timeout=180)
    try:
        with httpx.Client(base_url=eng.base_url, timeout=300) as api:

            def tokens(text: str) -> list[int]:
                return list(api.post("/tokenize", json={"content": text}).json()["tokens"])

            long_prompt = tokens(TEXT * 40)[:900]
            assert len(long_prompt) == 900
            first = {"prompt": long_prompt, "n_predict": 300, "ignore_eos": True, "temperature": 0}
            assert api.post("/completion", json={**first, "session_id": "s"}).status_code == 200
            # Same first 600 tokens, then a new tail: 600 cached tokens, but the window before
            # position 600 has been recycled, so they must be recomputed.
            second = long_prompt[:600] + tokens(" In short, the press")
            body = {"prompt": second, "n_predict": 24, "temperature": 0}
            reused = api.post("/completion", json={**body, "session_id": "s"}).json()
            fresh = api.post("/completion", json={**body, "cache_prompt": False}).json()
            assert reused["tokens"] == fresh["tokens"]
            assert reused["timings"]["cache_n"] == 0
        assert "sliding window before position 600 was recycled" in eng.log_tail(400)
    finally:
        eng.stop()
