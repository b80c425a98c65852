"""Admission and context plane through HTTP under a real decoding load."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polykv_engine.testing import EngineProcess

from .conftest import DETERMINISTIC
from .pool_helpers import ADMIN, complete, create, release_all, tokenize

# A floor no tiny-model session can reach: once one session decodes, the pool is saturated.
UNREACHABLE = 1e9


@pytest.fixture(scope="module")
def adm_engine(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    return start_engine(
        "-np", "4", "-c", "8192", "--metrics", "--polykv-admin-key", "admin-key",
        "--api-key", "infer-key", *DETERMINISTIC,
    )  # fmt: skip


@pytest.fixture
def ac(adm_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=adm_engine.base_url, timeout=60) as c:
        release_all(c)
        for slot in c.get("/slots", headers=ADMIN).json():
            c.post(f"/slots/{slot['id']}?action=erase", headers=ADMIN)
        yield c
        release_all(c)


def policy(c: httpx.Client, pool: str, **body: Any) -> dict[str, Any]:
    r = c.post(f"/polykv/pools/{pool}/admission", json=body, headers=ADMIN)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def capacity(c: httpx.Client, pool: str, **params: Any) -> dict[str, Any]:
    r = c.get(f"/polykv/pools/{pool}/capacity", params=params, headers=ADMIN)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


class Load:
    """Sessions decoding in the background, attached to a pool, until stopped."""

    def __init__(self, c: httpx.Client, pool: str, prompt: list[int], sessions: list[str]) -> None:
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(target=self._run, args=(str(c.base_url), pool, prompt, s))
            for s in sessions
        ]

    def _run(self, base: str, pool: str, prompt: list[int], session: str) -> None:
        with httpx.Client(base_url=base, timeout=120) as c:
            while not self.stop.is_set():
                r = complete(c, prompt, 400, pool_id=pool, session_id=session, ignore_eos=True)
                if r.status_code != 200:
                    self.errors.append(r.text)
                    return

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        assert not self.errors, self.errors


def wait_for(pred: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    # Generous: the machine is small and shared; this waits for state, it times nothing.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"condition not reached in {timeout:.0f}s: {what or pred!r}")


def saturated_pool(ac: httpx.Client, name: str, **pol: Any) -> list[int]:
    prompt = tokenize(ac, f"{name}: the shared instructions of this pool. " * 4)
    create(ac, tokens=prompt, name=name)
    body = dict(target_tps_per_session=UNREACHABLE, mode="enforced", settle_tokens=8,
                settle_max_ms=1000, guarantee_min_sessions=1)  # fmt: skip
    body.update(pol)
    policy(ac, name, **body)
    return prompt


class settled_and_active:  # lower case: reads as a condition at the call site
    """True once the pool's last admit settled and a session decodes; keeps the last reading
    so a timeout says where it stood."""

    def __init__(self, ac: httpx.Client, pool: str) -> None:
        self.ac, self.pool = ac, pool
        self.last: dict[str, Any] = {}

    def __call__(self) -> bool:
        self.last = capacity(self.ac, self.pool)
        return not self.last["settling"] and self.last["n_active"] >= 1

    def __repr__(self) -> str:
        return f"pool {self.pool} settled with an active session (last: {self.last})"


def test_advisory_reports_but_never_rejects(ac: httpx.Client) -> None:
    prompt = saturated_pool(ac, "adv", mode="advisory")
    with Load(ac, "adv", prompt, ["adv-bg"]):
        wait_for(settled_and_active(ac, "adv"))
        cap = capacity(ac, "adv")
        assert not cap["can_admit"] and cap["reason"] == "projected mean tps below floor"
        for i in range(3):
            r = complete(ac, prompt + [300 + i], 4, pool_id="adv", session_id=f"adv-{i}")
            assert r.status_code == 200, r.text


def test_enforced_reject_continuation_and_overcommit(ac: httpx.Client) -> None:
    prompt = saturated_pool(ac, "rej", guarantee_min_sessions=2)
    # Session B fits under the guarantee, finishes, and stays known (bound to its slot).
    r = complete(ac, prompt + [401], 4, pool_id="rej", session_id="rej-b")
    assert r.status_code == 200
    with Load(ac, "rej", prompt, ["rej-a"]):
        wait_for(settled_and_active(ac, "rej"))
        r = complete(ac, prompt + [402], 4, pool_id="rej", session_id="rej-new")
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"].isdigit() and int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error"
        assert err["reason"] == "tps_floor" and err["pool"] == "rej"
        # A known session's next turn is a continuation: never gated.
        r = complete(ac, prompt + [401, 5], 4, pool_id="rej", session_id="rej-b")
        assert r.status_code == 200, r.text
        # Explicit overcommit bypasses the gate.
        r = complete(ac, prompt + [403], 4, pool_id="rej", session_id="rej-oc", overcommit=True)
        assert r.status_code == 200, r.text
    assert _metric(ac, "polykv_pool_rejects_total", pool="rej") >= 1


def test_enforced_warn_admits_with_remaining_header(ac: httpx.Client) -> None:
    prompt = saturated_pool(ac, "warn", on_saturation="warn")
    with Load(ac, "warn", prompt, ["warn-bg"]):
        wait_for(settled_and_active(ac, "warn"))
        r = complete(ac, prompt + [404], 4, pool_id="warn", session_id="warn-new")
        assert r.status_code == 200, r.text
        assert r.headers["X-Sessions-Remaining"].isdigit()


def test_enforced_queue_holds_then_admits_or_times_out(ac: httpx.Client) -> None:
    prompt = saturated_pool(ac, "q", on_saturation="queue", queue_max_ms=1500)
    with Load(ac, "q", prompt, ["q-bg"]):
        wait_for(settled_and_active(ac, "q"))
        # Bounded: nothing frees up, so after queue_max_ms the answer is a 429.
        r = complete(ac, prompt + [405], 4, pool_id="q", session_id="q-1")
        assert r.status_code == 429, r.text
        # Held until headroom returns: here the floor is lowered while the request waits.
        result: dict[str, httpx.Response] = {}
        strict = dict(target_tps_per_session=UNREACHABLE, mode="enforced", settle_tokens=8,
                      settle_max_ms=1000, on_saturation="queue", queue_max_ms=20_000)  # fmt: skip
        policy(ac, "q", **strict)

        def queued() -> None:
            with httpx.Client(base_url=str(ac.base_url), timeout=60) as c:
                result["r"] = complete(c, prompt + [406], 4, pool_id="q", session_id="q-2")

        t = threading.Thread(target=queued)
        t.start()
        wait_for(lambda: _metric(ac, "polykv_pool_holds_total", pool="q") >= 2)
        assert t.is_alive()  # still held, not refused
        policy(ac, "q", target_tps_per_session=0.001, mode="enforced", on_saturation="queue")
        t.join(30)
        assert result["r"].status_code == 200, result["r"].text


def test_settling_holds_instead_of_rejecting(ac: httpx.Client) -> None:
    prompt = saturated_pool(
        ac, "settle", target_tps_per_session=0.001, settle_tokens=100_000, settle_max_ms=5000
    )
    with Load(ac, "settle", prompt, ["settle-bg"]):
        # The answer that showed the window open is the one checked (a second read could
        # come after the window closed on a busy machine).
        seen: dict[str, Any] = {}
        wait_for(lambda: seen.update(capacity(ac, "settle")) or seen["settling"])
        cap = seen
        assert not cap["can_admit"] and cap["reason"] == "measurement settling"
        assert 0 < cap["settle_remaining_ms"] <= 5000
        holds = _metric(ac, "polykv_pool_holds_total", pool="settle")
        r = complete(ac, prompt + [407], 4, pool_id="settle", session_id="settle-new")
        assert r.status_code == 200, r.text  # held until the window closed, then admitted
        assert _metric(ac, "polykv_pool_holds_total", pool="settle") == holds + 1


def test_new_pool_always_admits_its_first_session(ac: httpx.Client) -> None:
    busy = saturated_pool(ac, "busy")
    with Load(ac, "busy", busy, ["busy-bg"]):
        wait_for(settled_and_active(ac, "busy"))
        fresh = saturated_pool(ac, "fresh")
        cap = capacity(ac, "fresh")
        assert cap["can_admit"] and cap["guaranteed"] and cap["reason"] == "guaranteed minimum"
        r = complete(ac, fresh + [408], 4, pool_id="fresh", session_id="fresh-1")
        assert r.status_code == 200, r.text


def test_context_arm_and_capacity_fields(ac: httpx.Client) -> None:
    saturated_pool(ac, "ctx")
    cap = capacity(ac, "ctx", expected_tokens=10_000_000)
    assert not cap["can_admit"] and cap["reason"] == "context headroom exhausted"
    cap = capacity(ac, "ctx", expected_tokens=100)
    for key in ("projected_mean_tps_if_admitted", "projected_mean_tps_model",
                "projected_mean_tps_measured", "projected_idle_estimate", "drop_per_admit_ewma",
                "headroom_sessions", "kv_headroom_pct", "settle_remaining_ms", "n_warming",
                "n_pool_sessions", "known_session", "compaction_pressure"):  # fmt: skip
        assert key in cap
    assert 0.0 <= cap["compaction_pressure"] <= 1.0
    assert cap["policy"]["target_tps_per_session"] == UNREACHABLE
    status = ac.get("/polykv/pools/ctx", headers=ADMIN).json()
    assert status["admission"]["mode"] == "enforced"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "target_tps_per_session"),
        ({"target_tps_per_session": 0}, "target_tps_per_session"),
        ({"target_tps_per_session": 5, "mode": "strict"}, "mode"),
        ({"target_tps_per_session": 5, "on_saturation": "drop"}, "on_saturation"),
        ({"target_tps_per_session": 5, "settle_tokens": 0}, "settle_tokens"),
    ],
)
def test_bad_policies_are_400_and_change_nothing(
    ac: httpx.Client, body: dict[str, Any], needle: str
) -> None:
    create(ac, prompt="x y z", name="badpol")
    r = ac.post("/polykv/pools/badpol/admission", json=body, headers=ADMIN)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]
    assert ac.get("/polykv/pools/badpol", headers=ADMIN).json()["admission"] is None


def test_admission_routes_reject_unknown_pools_and_wrong_keys(ac: httpx.Client) -> None:
    r = ac.post("/polykv/pools/ghost/admission", json={"target_tps_per_session": 5}, headers=ADMIN)
    assert r.status_code == 404
    assert ac.get("/polykv/pools/ghost/capacity", headers=ADMIN).status_code == 404
    create(ac, prompt="x y z", name="keyed")
    infer = {"Authorization": "Bearer infer-key"}
    r = ac.post("/polykv/pools/keyed/admission", json={"target_tps_per_session": 5}, headers=infer)
    assert r.status_code == 403
    assert ac.get("/polykv/pools/keyed/capacity", headers=infer).status_code == 200
    r = ac.get("/polykv/pools/keyed/capacity?expected_tokens=abc", headers=ADMIN)
    assert r.status_code == 400


def test_pool_metrics_have_only_the_pool_label(ac: httpx.Client) -> None:
    prompt = saturated_pool(ac, "metered", mode="advisory")
    complete(ac, prompt + [1], 4, pool_id="metered", session_id="m-1")
    text = ac.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("polykv_pool_sessions", "polykv_pool_own_kv_bytes", "polykv_pool_subtree_kv_bytes",
                 "polykv_pool_gen_throughput_tps", "polykv_pool_mean_active_tps",
                 "polykv_pool_compaction_pressure", "polykv_pool_admits",
                 "polykv_pool_prefix_hits"):  # fmt: skip
        assert name in fams, name
        for s in fams[name].samples:
            assert set(s.labels) <= {"pool"}, s
    assert _metric(ac, "polykv_pool_sessions", pool="metered") == 1
    assert _metric(ac, "polykv_pool_prefix_hits_total", pool="metered") >= 1
    assert "m-1" not in text


def _metric(c: httpx.Client, name: str, **labels: str) -> float:
    return _sample(c.get("/metrics").text, name, **labels)


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_pool_session_past_the_context_stops_cleanly_and_the_pool_survives(
    start_engine: Callable[..., EngineProcess],
) -> None:
    # --parallel 1 so the session reaches its positional wall before the cells run out.
    eng = start_engine("-np", "1", "-c", "512", "--context-shift", *DETERMINISTIC)
    with httpx.Client(base_url=eng.base_url, timeout=60) as c:
        prefix = tokenize(c, "The shared prefix that every agent of this pool starts with. " * 3)
        create(c, tokens=prefix, name="wall")
        probe = prefix + tokenize(c, " question", add_special=False)
        before = complete(c, probe, 16, pool_id="wall", cache_prompt=False).json()["content"]
        r = complete(c, prefix + [5], 2000, pool_id="wall", ignore_eos=True)
        body = r.json()
        assert r.status_code == 200
        assert body["truncated"] is True and body["stop_type"] == "limit"
        assert body["tokens_evaluated"] + body["tokens_predicted"] <= 512 + 1
        after = complete(c, probe, 16, pool_id="wall", cache_prompt=False).json()
        assert after["content"] == before  # the pool's cells were never shifted
        assert after["timings"]["cache_n"] >= len(prefix) - 1
        # Off the pool path, --context-shift still shifts and keeps generating.
        c.post("/slots/0?action=erase")
        c.delete("/polykv/pools/wall")
        r = complete(c, [256, 5, 6, 7], 700, ignore_eos=True)
        assert r.json()["truncated"] is False and r.json()["tokens_predicted"] == 700


def test_a_released_pools_series_disappear_from_metrics(ac: httpx.Client) -> None:
    prompt = saturated_pool(ac, "ephemeral", mode="advisory")
    complete(ac, prompt + [7], 2, pool_id="ephemeral", session_id="eph-1")
    assert _metric(ac, "polykv_pool_queries_total", pool="ephemeral") >= 1
    assert _metric(ac, "polykv_pool_sessions", pool="ephemeral") == 1
    assert ac.delete("/polykv/pools/ephemeral", headers=ADMIN).status_code == 200

    def gone() -> bool:
        text = ac.get("/metrics").text
        return 'pool="ephemeral"' not in text

    wait_for(gone)


def test_autoscale_signals_idle_zero_pressure_and_refused_demand(
    start_engine: Callable[..., EngineProcess],
) -> None:
    eng = start_engine("-np", "4", "-c", "8192", "--metrics")  # its own: no refusals before
    with httpx.Client(base_url=eng.base_url, timeout=60) as ac:

        def gauge(name: str, **labels: str) -> float:
            return _metric(ac, name, **labels)

        # Idle: every signal has a value, and it is 0 (an HPA must see "scale down").
        text = ac.get("/metrics").text
        for name in ("polykv_floor_pressure", "polykv_session_demand_ratio",
                     "polykv_sessions_active", "polykv_sessions_refused"):  # fmt: skip
            assert f"\n{name} 0.0" in text, name
        prompt = saturated_pool(ac, "scale")
        with Load(ac, "scale", prompt, ["scale-a"]):
            wait_for(settled_and_active(ac, "scale"))
            # An unreachable floor: the measured session runs under it.
            assert gauge("polykv_floor_pressure") > 1
            assert gauge("polykv_pool_active_sessions", pool="scale") == 1
            assert gauge("polykv_pool_floor_tps", pool="scale") == UNREACHABLE

            # One scrape for both, and a scrape where the rate held still: the pool gauges and
            # the pressure read the rate a moment apart, and on a loaded machine it swings.
            def consistent() -> bool:
                scrape = ac.get("/metrics").text
                tps_sum = _sample(scrape, "polykv_pool_active_tps_sum", pool="scale")
                pressure = _sample(scrape, "polykv_floor_pressure")
                return tps_sum > 0 and pressure == pytest.approx(UNREACHABLE / tps_sum, rel=0.3)

            wait_for(consistent, what="floor pressure = floor / the pool's mean tps")
            for i in range(3):
                body = prompt + [500 + i]
                r = complete(ac, body, 4, pool_id="scale", session_id=f"scale-new-{i}")
                assert r.status_code == 429
            assert gauge("polykv_sessions_refused") == 3
            assert gauge("polykv_pool_refused_sessions", pool="scale") == 3
            assert gauge("polykv_session_demand_ratio") > gauge("polykv_sessions_active") / 8
        listing = ac.get("/polykv/pools").json()
        assert listing["sessions_refused"] == 3


def test_projection_counts_sessions_between_turns_and_uses_the_step_curve(
    ac: httpx.Client,
) -> None:
    prompt = saturated_pool(ac, "paused", mode="advisory")  # reports, never refuses
    # Session "tool-call" runs one short turn and then "calls a tool" (stays away < 10 s).
    r = complete(ac, prompt, 4, pool_id="paused", session_id="tool-call")
    assert r.status_code == 200, r.text
    with Load(ac, "paused", prompt, ["busy-0", "busy-1"]):
        cond = settled_and_active(ac, "paused")
        wait_for(lambda: cond() and cond.last["n_active"] == 2, what=repr(cond))
        cap = cond.last
        # Two measured decoders, one returning session: admitting makes four decode together.
        # The flat-aggregate model is exact arithmetic on the same reading.
        assert cap["projected_mean_tps_model"] == pytest.approx(cap["mean_active_tps"] * 2 / 4)

        def curve_sizes(family: str = "polykv_decode_step_seconds") -> set[str]:
            text = ac.get("/metrics").text
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            return {s.labels["batch"] for s in fams[family].samples}

        # Decode-only steps with one and two sessions were timed: the curve is measured.
        wait_for(lambda: {"1", "2"} <= curve_sizes(), what="step curve at sizes 1 and 2")
        # And the token-to-token times of the two decoding together, admission's cap.
        wait_for(lambda: "2" in curve_sizes("polykv_decode_cycle_seconds"), what="cycle at 2")
        wait_for(lambda: capacity(ac, "paused")["projected_mean_tps_measured"] is not None)
        cap = capacity(ac, "paused")
        assert 0 < cap["projected_mean_tps_measured"] <= cap["mean_active_tps"] * 1.05
