"""The admission math against hand-computed cases, including the spec's §14.1 failure run."""

from __future__ import annotations

import pytest

from polykv_api.models import AdmissionPolicy
from polykv_engine.policy.admission import (
    REASON_CONTEXT,
    REASON_FLOOR,
    REASON_FLOOR_IDLE,
    REASON_GUARANTEED,
    REASON_KV,
    REASON_OK,
    REASON_SETTLING,
    EngineView,
    PoolAdmissionState,
    SessionView,
    capacity,
    compaction_pressure,
    retry_after_s,
)


def sess(tps: float, task: int = 0, warming: bool = False, decoded: int = 100,
         in_pool: bool = True, ctx: int = 300, private: int = 100) -> SessionView:  # fmt: skip
    return SessionView(task, True, warming, tps, decoded, in_pool, ctx, private)


def view(*sessions: SessionView, free: int = 10_000, total: int = 16_384) -> EngineView:
    return EngineView(tuple(sessions), free, total, 8192, idle_slots=4, pool_prefix_len=200)


FLOOR15 = AdmissionPolicy(target_tps_per_session=15.0, mode="enforced", guarantee_min_sessions=1)


def test_model_projection_n_over_n_plus_one() -> None:
    cap = capacity(FLOOR15, PoolAdmissionState(), view(sess(20), sess(20)), now=0)
    assert cap.projected_mean_tps_model == pytest.approx(20 * 2 / 3)
    assert cap.projected_mean_tps_measured is None
    assert cap.projected_mean_tps_if_admitted == pytest.approx(40 / 3)
    assert not cap.can_admit and cap.reason == REASON_FLOOR


def test_warming_sessions_are_excluded_from_the_mean() -> None:
    # Right after a spawn the new session reads 0 tps: it must not drag the mean to 10.
    v = view(sess(20), sess(0, warming=True))
    cap = capacity(FLOOR15, PoolAdmissionState(), v, now=0)
    assert cap.mean_active_tps == 20 and cap.n_warming == 1 and cap.n_active == 1
    assert cap.projected_mean_tps_model == pytest.approx(10.0)


def test_courier_run_stale_ewma_and_measured_drop() -> None:
    """§14.1: the courier run went 38 → 31.7 → 21.7 → 15.9 → 11.6 tps as it admitted
    workers against a floor of 15, because (1) it re-admitted before the EWMA absorbed the
    last admit and (2) nothing learned what an admit really costs.

    Here the settle window blocks (1), and the learned drop factor (measured drop ÷ the
    n/(n+1) model's drop) admits exactly the sessions that stayed above the floor (down to
    15.9) and refuses the one that took the real run to 11.6."""
    policy = AdmissionPolicy(
        target_tps_per_session=15.0, mode="enforced", settle_tokens=48, settle_max_ms=5000
    )
    st = PoolAdmissionState()
    t = 0.0
    sessions = [sess(38.0, task=1)]
    for step, after in enumerate([31.7, 21.7, 15.9]):
        v = view(*sessions)
        cap = capacity(policy, st, v, now=t)
        assert cap.can_admit, (step, cap)
        st.record_admit(task_id=step + 2, view=v, now=t)
        # Stale EWMA: a tick later nothing has moved yet; the gate must say "settling".
        t += 1.0
        assert capacity(policy, st, view(*sessions), now=t).reason == REASON_SETTLING
        # The admitted session decodes its 48 tokens; everyone slows to the new mean.
        sessions = [sess(after, task=i + 1) for i in range(len(sessions) + 1)]
        t += 2.0
        assert st.update(policy, view(*sessions), now=t)
        assert st.settle is None
    factors = [6.3 / (38 / 2), 10.0 / (31.7 / 3), 5.8 / (21.7 / 4)]
    k = factors[0]
    for f in factors[1:]:
        k = 0.3 * f + 0.7 * k
    assert st.drop_factor == pytest.approx(k)
    assert st.history == pytest.approx([6.3, 10.0, 5.8])
    cap = capacity(policy, st, view(*sessions), now=t)
    assert cap.drop_per_admit_ewma == pytest.approx(k * 15.9 / 5)
    assert cap.projected_mean_tps_measured == pytest.approx(15.9 - k * 15.9 / 5)
    assert not cap.can_admit and cap.reason == REASON_FLOOR


def test_settle_closes_on_tokens_or_timeout_never_on_a_short_turn() -> None:
    policy = AdmissionPolicy(target_tps_per_session=5.0, settle_tokens=48, settle_max_ms=1000)
    st = PoolAdmissionState()
    st.record_admit(7, view(sess(30, task=1)), now=0.0)
    assert not st.update(policy, view(sess(30, task=1), sess(0, task=7, decoded=3)), now=0.5)
    assert st.settle_remaining_ms(policy, 0.5) == pytest.approx(500)
    # The admitted turn ended before 48 tokens: the mean without it says nothing yet.
    assert not st.update(policy, view(sess(30, task=1)), now=0.9)
    assert st.update(policy, view(sess(30, task=1)), now=1.0)  # timed out
    st.record_admit(8, view(sess(30, task=1)), now=2.0)
    assert st.update(policy, view(sess(25, task=1), sess(25, task=8, decoded=48)), now=2.2)


def test_a_busy_pool_keeps_its_idle_estimate_fresh() -> None:
    st = PoolAdmissionState(drop_factor=1.0)
    policy = FLOOR15
    # Sessions decode now and then, with no admit for minutes: the settled mean follows.
    st.update(policy, view(sess(16.0), sess(16.0)), now=100.0)
    idle = SessionView(None, False, False, 16.0, 0, True, 300, 100)
    cap = capacity(policy, st, view(idle, idle), now=125.0)
    assert cap.projected_idle_estimate and not cap.can_admit
    assert cap.reason == REASON_FLOOR_IDLE


def test_a_partly_paused_pool_is_judged_at_its_full_size() -> None:
    st = PoolAdmissionState(last_settled_mean=16.0, last_settled_ts=99.0)
    paused = SessionView(None, False, False, 16.0, 0, True, 300, 100)
    # One of two agents is in a tool call: the other alone reads 30 tok/s.
    cap = capacity(FLOOR15, st, view(sess(30.0), paused), now=100.0)
    assert cap.projected_mean_tps_model == pytest.approx(16.0 * 2 / 3)
    assert not cap.can_admit and cap.reason == REASON_FLOOR


def test_guarantee_admits_the_first_session_even_when_saturated() -> None:
    v = view(sess(1.0, in_pool=False), sess(1.0, in_pool=False), free=0)
    cap = capacity(FLOOR15, PoolAdmissionState(), v, now=0)
    assert cap.can_admit and cap.guaranteed and cap.reason == REASON_GUARANTEED
    # ...but never past the context arm: cells are physical.
    cap = capacity(FLOOR15, PoolAdmissionState(), v, now=0, expected_tokens=10)
    assert not cap.can_admit and cap.reason == REASON_CONTEXT


def test_context_arm() -> None:
    v = view(sess(30), free=5000)
    assert capacity(None, PoolAdmissionState(), v, 0, expected_tokens=8192 - 200 + 1).reason == (
        REASON_CONTEXT
    )
    assert capacity(None, PoolAdmissionState(), v, 0, expected_tokens=6000).reason == REASON_CONTEXT
    assert capacity(None, PoolAdmissionState(), v, 0, expected_tokens=4000).can_admit


def test_kv_headroom_uses_marginal_not_full_context() -> None:
    v = view(sess(30, private=100), sess(30, private=300), free=1000)
    cap = capacity(None, PoolAdmissionState(), v, 0)
    assert cap.headroom_sessions == 4  # min(1000 // 200, 4 idle slots)
    cap = capacity(None, PoolAdmissionState(), view(sess(30, private=100), free=50), 0)
    assert not cap.can_admit and cap.reason == REASON_KV


def test_idle_gap_estimate() -> None:
    st = PoolAdmissionState(last_settled_mean=16.0, last_settled_ts=100.0)
    idle = SessionView(None, False, False, 16.0, 0, True, 300, 100)
    v = view(idle, idle, idle)
    cap = capacity(FLOOR15, st, v, now=110.0)
    assert cap.projected_idle_estimate
    assert cap.projected_mean_tps_if_admitted == pytest.approx(16.0 * 3 / 4)
    assert cap.reason == REASON_FLOOR_IDLE
    stale = capacity(FLOOR15, st, v, now=200.0)  # a 100 s old sample says nothing
    assert not stale.projected_idle_estimate and stale.can_admit


def test_known_session_is_a_continuation() -> None:
    v = view(sess(1.0), sess(1.0))
    assert capacity(FLOOR15, PoolAdmissionState(), v, 0, known_session=True).reason == REASON_OK


def test_no_policy_means_no_floor() -> None:
    cap = capacity(None, PoolAdmissionState(), view(sess(1.0)), 0)
    assert cap.can_admit and cap.reason == REASON_OK


def test_compaction_pressure() -> None:
    assert compaction_pressure(view(sess(1, ctx=100), free=16_000)) == 0.0
    assert compaction_pressure(view(sess(1, ctx=100), free=0)) == 1.0
    assert compaction_pressure(view(sess(1, ctx=8192 * 3 // 4))) == pytest.approx(0.5)


def test_retry_after_is_a_whole_number_of_seconds() -> None:
    st = PoolAdmissionState()
    st.record_admit(1, view(sess(30)), now=0.0)
    cap = capacity(FLOOR15, st, view(sess(30)), now=1.2)
    assert cap.settling and retry_after_s(cap, FLOOR15) == 4
    cap = capacity(FLOOR15, PoolAdmissionState(), view(sess(1), sess(1)), now=0)
    assert retry_after_s(cap, FLOOR15) == 5
