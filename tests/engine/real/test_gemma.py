"""A sliding-window model (Gemma 3, llama.cpp's iSWA cache): pools held whole past the window
(guard sequences, a full-size SWA cache) and equal to unpooled output, and prompt caching
that never reuses a prefix whose window was recycled."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polykv_engine.testing import EngineProcess

pytestmark = pytest.mark.real_model

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, sold and read across Europe. "
)


def test_pools_stay_whole_past_the_window_and_equal_unpooled(gemma3: Path, tmp_path: Path) -> None:
    # Gemma 3 270M: a 512-token window in 15 of its 18 layers. A 640-token pool and a branch
    # past the window; then a session that held the cache's first cells goes and another
    # sweeps over the pools' cells: the guard sequences keep them.
    # Without pools, a window-sized cache would hold 1536 cells (512 x 2 sessions + 512).
    args = ["-np", "2", "-c", "16384", "-ctk", "f32", "-ctv", "f32", "-fa", "off"]
    eng = EngineProcess(gemma3, args, log_path=tmp_path / "e.log")
    eng.start(timeout=180)
    try:
        with httpx.Client(base_url=eng.base_url, timeout=300) as api:

            def tokens(text: str, special: bool = True) -> list[int]:
                body = {"content": text, "add_special": special}
                return list(api.post("/tokenize", json=body).json()["tokens"])

            def greedy(prompt: list[int], n: int = 12, **extra: object) -> dict[str, object]:
                body = {"prompt": prompt, "n_predict": n, "temperature": 0, **extra}
                r = api.post("/completion", json=body)
                assert r.status_code == 200, r.text
                out: dict[str, object] = r.json()
                return out

            memory = api.get("/props").json()["polykv"]["memory"]
            assert (memory["kind"], memory["sliding_window"]) == ("sliding_window", 512)
            assert memory["swa_full"]
            assert memory["swa_full_extra_bytes"] == (16384 - 1536) * 15 * 2 * 256 * 4
            # The file carries no chat template: chat renders Gemma's turns, not ChatML.
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
            chat = api.post("/apply-template", json={"messages": msgs}).json()["prompt"]
            assert chat.endswith(
                "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
            ), chat
            assert "<|im_start|>" not in chat
            below = greedy(tokens(TEXT * 14)[:300], 4, session_id="below")
            system = tokens(TEXT * 30)[:640]
            tail = tokens(" Summarize it for a child:", special=False)
            r = api.post("/polykv/pools", json={"tokens": system, "name": "g"})
            assert r.status_code == 201, r.text
            fork = {"tokens": system[:560] + tail, "name": "g-branch"}
            assert api.post("/polykv/pools/g/fork", json=fork).status_code == 201
            asks = {
                "g": system + tail,
                "g-branch": system[:560] + tail + tail,
            }

            def top(prompt: list[int], **extra: object) -> dict[int, float]:
                """The next token's 5 most likely and their logprobs."""
                got = greedy(prompt, 1, cache_prompt=False, n_probs=5, **extra)
                if "pool_id" in extra:
                    assert got["timings"]["cache_n"] >= 560  # type: ignore[index]
                first = got["completion_probabilities"][0]  # type: ignore[index]
                return {t["id"]: t["logprob"] for t in first["top_logprobs"]}

            fresh = {k: top(v) for k, v in asks.items()}

            def attach_all() -> None:
                # Batch shapes move Gemma's logprobs by a few hundredths of a nat (the
                # branch's first token is such a near-tie); holes in the window by whole ones.
                for name, prompt in asks.items():
                    pooled = top(prompt, pool_id=name)
                    for tok, logprob in list(fresh[name].items())[:3]:
                        assert abs(pooled.get(tok, -99.0) - logprob) < 0.25, (name, tok)

            attach_all()
            slot = below["id_slot"]
            assert api.post(f"/slots/{slot}?action=erase").status_code == 200
            # A session past the window, its tokens landing in the freed cells and on.
            greedy(tokens(TEXT * 20)[:520], 48, ignore_eos=True)
            attach_all()
        assert "pools keep their cells with guard sequences" in eng.log_tail(400)
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


@contextlib.contextmanager
def gemma_api(model: Path, tmp_path: Path, args: list[str]) -> Iterator[httpx.Client]:
    """A client of an engine on ``model`` started with ``args``, stopped afterwards."""
    eng = EngineProcess(model, args, log_path=tmp_path / "e.log")
    eng.start(timeout=180)
    try:
        with httpx.Client(base_url=eng.base_url, timeout=300) as api:
            yield api
    finally:
        eng.stop()


def test_sessions_share_a_long_prompt_without_a_pool(gemma3: Path, tmp_path: Path) -> None:
    # What an agent CLI sends: every session starts with the same long system prompt. The
    # second session takes the first one's cells (automatic sharing, no pool named) past the
    # 512-token window, and its next token's logprobs are a fresh run's.
    args = ["-np", "3", "-c", "4096", "-ctk", "f32", "-ctv", "f32", "-fa", "off"]
    with gemma_api(gemma3, tmp_path, args) as api:

        def tokens(text: str, special: bool) -> list[int]:
            body = {"content": text, "add_special": special}
            return list(api.post("/tokenize", json=body).json()["tokens"])

        system = tokens(TEXT * 20, True)[:700]
        asks = [
            system + tokens(q, False)
            for q in (" Who printed the first Bible?", " Summarize it for a child:")
        ]

        def top(prompt: list[int], **extra: object) -> tuple[dict[str, int], dict[int, float]]:
            body = {"prompt": prompt, "n_predict": 1, "n_probs": 5, "temperature": 0}
            got = api.post("/completion", json={**body, **extra}).json()
            first = got["completion_probabilities"][0]
            probs = {t["id"]: t["logprob"] for t in first["top_logprobs"]}
            return {"slot": got["id_slot"], **got["timings"]}, probs

        ran, fresh = top(asks[1], cache_prompt=False)
        assert api.post(f"/slots/{ran['slot']}?action=erase").status_code == 200
        assert top(asks[0], session_id="a")[0]["cache_n"] == 0
        ran, shared = top(asks[1], session_id="b")
        assert ran["cache_n"] >= len(system)
        for tok, logprob in list(fresh.items())[:3]:
            assert abs(shared.get(tok, -99.0) - logprob) < 0.25, tok
