"""The one engine client of the benchmarks: the HTTP routes they call (``Api``), one streamed
completion timed to its first token, k of them released at one instant, and the KV figures
of the pool listing."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .harness import BenchError, CpuWatch, run_together, sse_events


@dataclass
class Api:
    """The engine's HTTP routes the benchmarks use."""

    client: httpx.Client
    base_url: str
    pid: int

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self.client.request(method, self.url(path), **kw)
        if resp.status_code >= 300:
            raise BenchError(f"{method} {path} -> {resp.status_code}: {resp.text[:400]}")
        return resp.json()

    def get(self, path: str) -> Any:
        return self._json("GET", path)

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._json("POST", path, json=body or {})

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        out = self.post("/tokenize", {"content": text, "add_special": add_special})
        return [int(t) for t in out["tokens"]]

    def props(self) -> dict[str, Any]:
        return dict(self.get("/props")["polykv"])

    def pools(self) -> dict[str, Any]:
        return dict(self.get("/polykv/pools"))

    def create_pool(self, name: str, tokens: Sequence[int]) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        out = self.post("/polykv/pools", {"name": name, "tokens": list(tokens)})
        return dict(out), time.perf_counter() - t0

    def fork_pool(
        self, parent: str, name: str, tokens: Sequence[int], branch_pos: int
    ) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        body = {"name": name, "tokens": list(tokens), "branch_pos": branch_pos}
        out = self.post(f"/polykv/pools/{parent}/fork", body)
        return dict(out), time.perf_counter() - t0

    def wait_idle(self, limit_s: float = 300.0) -> None:
        """Until no slot is processing: a run's last requests may still be finishing after
        its clients stopped waiting for them."""
        deadline = time.monotonic() + limit_s
        while any(s["is_processing"] for s in self.get("/slots")):
            if time.monotonic() > deadline:
                raise BenchError(f"slots still processing after {limit_s:.0f} s")
            time.sleep(0.1)

    def reset(self, n_slots: int, keep: Sequence[str] = ()) -> None:
        """Every slot's cache erased, every pool but ``keep`` released (children first)."""
        self.wait_idle()
        for slot in range(n_slots):
            self.post(f"/slots/{slot}?action=erase")
        listing = self.pools()
        for p in sorted(listing["pools"], key=lambda p: -int(p["depth"])):
            if p["name"] not in keep:
                self._json("DELETE", f"/polykv/pools/{p['pool_id']}")
        after = self.pools()
        kept = sum(int(p["own_kv_bytes"]) for p in after["pools"])
        if after["kv_bytes_used"] != kept or len(after["pools"]) != len(keep):
            raise BenchError(f"KV not reset: {after['kv_cells_used']} cells in use")


@dataclass(frozen=True, slots=True)
class SessionResult:
    ttft_ms: float
    server_prompt_ms: float
    prompt_n: int
    cache_n: int


@dataclass(frozen=True, slots=True)
class Turn:
    """One streamed completion as the client saw it (perf-counter times), on either server
    (llama-server's ``/completion`` streams the same events)."""

    sent: float
    token_times: tuple[float, ...]  # each generated token's arrival
    final: dict[str, Any]  # the last event: timings, id_slot, tokens_cached

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def timings(self) -> dict[str, Any]:
        return dict(self.final["timings"])


def stream_turn(client: httpx.Client, base_url: str, body: dict[str, Any]) -> Turn:
    """Stream one completion from ``base_url``, timing each token as it arrives."""
    sent = time.perf_counter()
    times: list[float] = []
    final: dict[str, Any] = {}
    for t, payload in sse_events(client, f"{base_url}/completion", body):
        if payload.get("stop"):
            final = payload
        else:
            times.extend(t for _ in payload.get("tokens") or ())
    if not times or not final.get("timings"):
        raise BenchError(f"{base_url}: no token or no final event for a session: {final}")
    return Turn(sent, tuple(times), final)


def run_one(api: Api, body: dict[str, Any]) -> SessionResult:
    """Stream one completion; its first token event is its time to first token."""
    turn = stream_turn(api.client, api.base_url, body)
    return SessionResult(
        ttft_ms=1e3 * turn.ttft_s,
        server_prompt_ms=float(turn.timings["prompt_ms"]),
        prompt_n=int(turn.timings["prompt_n"]),
        cache_n=int(turn.timings["cache_n"]),
    )


def completion_body(prompt: Sequence[int], **extra: Any) -> dict[str, Any]:
    return {
        "prompt": list(prompt),
        "n_predict": 1,  # the first token is the whole answer: KV then holds the prompt only
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


def run_sessions(api: Api, bodies: Sequence[dict[str, Any]]) -> tuple[list[SessionResult], float]:
    """Release every body at one instant; returns results and the other processes' cores."""
    with CpuWatch([api.pid]) as cpu:
        results = run_together([functools.partial(run_one, api, b) for b in bodies], lambda: None)
    return results, cpu.foreign_cores


def kv_state(api: Api) -> dict[str, Any]:
    listing = api.pools()
    sessions = [s for p in listing["pools"] for s in p["sessions"]]
    sessions += listing["unpooled_sessions"]
    return {
        "bytes_per_token": listing["kv_bytes_per_token"],
        "cells_used": listing["kv_cells_used"],
        "cells_measured": listing["kv_cells_measured"],
        "bytes_used": listing["kv_bytes_used"],
        "pools": [
            {
                "name": p["name"],
                "prefix_len": p["prefix_len"],
                "branch_pos": p["branch_pos"],
                "own_kv_bytes": p["own_kv_bytes"],
                "subtree_kv_bytes": p["subtree_kv_bytes"],
            }
            for p in listing["pools"]
        ],
        "session_marginal_bytes": sorted(s["marginal_kv_bytes"] for s in sessions),
    }
