"""tps instrumentation against what a client measures, and how it is exposed."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polykv_engine.policy.tps import DEFAULT_WINDOW_S, DEFAULT_WINDOW_TOKENS, SessionRate
from polykv_engine.testing import EngineProcess, running_engine

from .conftest import greedy
from .test_completion import sse_events


def _stream_and_time(base_url: str, n: int, session: str) -> tuple[list[float], dict[str, object]]:
    arrivals: list[float] = []
    final: dict[str, object] = {}
    body = greedy("Measure me: ", n=n, ignore_eos=True, stream=True, session_id=session)
    with httpx.stream("POST", f"{base_url}/completion", json=body, timeout=120) as resp:
        for data in sse_events(resp):
            ev = json.loads(data)
            if ev["stop"]:
                final = ev
            else:
                arrivals.append(time.perf_counter())
    return arrivals, final


@pytest.mark.slow
def test_session_tps_ewma_matches_client_measured_rate(bench_model: Path, tmp_path: Path) -> None:
    # The engine's EWMA, applied to the times the client received each token, must give what
    # the engine reports: it measures tokens where the client sees them, not something else.
    # Same estimator on both sides, so a rate that drifts during the run (a busy machine, a
    # growing context) moves both alike. Every token is its own write here (stream interval
    # 0): grouped writes would hand the client several tokens at one instant.
    errors = []
    args = ["-np", "1", "-c", "1024", "--polykv-stream-interval-ms", "0"]
    with running_engine(bench_model, args, tmp_path / "e.log") as eng:
        for attempt in range(3):
            arrivals, final = _stream_and_time(eng.base_url, 200, f"tps-{attempt}")
            client = SessionRate(DEFAULT_WINDOW_TOKENS, DEFAULT_WINDOW_S)
            for t in arrivals:
                client.on_token(t)
            ewma = final["polykv"]["tps_ewma"]  # type: ignore[index]
            errors.append(abs(ewma - client.tps) / client.tps)
            if errors[-1] <= 0.02:
                break
    print(f"engine EWMA vs the client's: relative errors {errors}")
    assert min(errors) <= 0.02, errors


def test_tps_snapshot_while_sessions_decode(engine: EngineProcess) -> None:
    stop = threading.Event()

    def load(i: int) -> None:
        while not stop.is_set():
            httpx.post(
                f"{engine.base_url}/completion",
                json=greedy(f"load {i} ", n=300, ignore_eos=True, session_id=f"load-{i}"),
                timeout=120,
            )

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        snap: dict[str, object] = {}
        while time.monotonic() < deadline:
            snap = httpx.get(f"{engine.base_url}/polykv/tps").json()
            if snap["n_active"] == 2 and snap["n_warming"] == 0:
                break
            time.sleep(0.02)
        assert snap["n_active"] == 2, snap
        assert snap["aggregate_tps"] > 0 and snap["mean_active_tps"] > 0  # type: ignore[operator]
        sessions = {s["session_id"]: s for s in snap["sessions"]}  # type: ignore[attr-defined]
        for i in range(2):
            s = sessions[f"load-{i}"]
            assert s["ctx_total"] > s["ctx_used"] > 0
            assert s["ctx_headroom_tokens"] == s["ctx_total"] - s["ctx_used"]
        rates = [s["tps_ewma"] for s in sessions.values() if s["state"] == "decoding"]
        assert abs(snap["mean_active_tps"] - sum(rates) / len(rates)) < 1e-6 * max(rates) + 1e-9  # type: ignore[operator]
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_tps_sse_stream(engine: EngineProcess) -> None:
    got = []
    with httpx.stream(
        "GET",
        f"{engine.base_url}/polykv/tps?interval_ms=100",
        headers={"Accept": "text/event-stream"},
        timeout=30,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for data in sse_events(resp):
            got.append(json.loads(data))
            if len(got) == 3:
                break
    assert all(
        {"ts", "aggregate_tps", "mean_active_tps", "n_warming", "sessions"} <= set(g) for g in got
    )
    assert got[0]["ts"] <= got[1]["ts"] <= got[2]["ts"]


def test_metrics_parse_and_count(engine: EngineProcess) -> None:
    before = _metrics(engine.base_url)
    httpx.post(f"{engine.base_url}/completion", json=greedy("count me", n=5), timeout=60)
    after = _metrics(engine.base_url)
    assert after["polykv_tokens_predicted_total"] >= before["polykv_tokens_predicted_total"] + 5
    assert (
        after['polykv_requests_total{outcome="done"}']
        >= before['polykv_requests_total{outcome="done"}'] + 1
    )
    assert "polykv_mean_active_tps" in after and "polykv_kv_cells_total" in after
    httpx.post(
        f"{engine.base_url}/completion", json=greedy("x", n=2, session_id="secret-sess"), timeout=60
    )
    text = httpx.get(f"{engine.base_url}/metrics").text
    assert "secret-sess" not in text  # never a per-session label or value
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            # Low cardinality only: "batch" is bounded by -np (the step-time curve), "omp_wait"
            # names one of five wait policies.
            allowed = {"outcome", "route", "code", "pool", "batch", "omp_wait"}
            assert set(sample.labels) <= allowed, sample


def _metrics(base_url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
