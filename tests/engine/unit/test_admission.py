"""The admission math against hand-computed cases, including the spec's §14.1 failure run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from polykv_api.models import AdmissionPolicy, Capacity
from polykv_engine.policy.admission import (
    REASON_CONTEXT,
    REASON_FLOOR,
    REASON_FLOOR_IDLE,
    REASON_GUARANTEED,
    REASON_KV,
    REASON_OK,
    REASON_PREFILL,
    REASON_SETTLING,
    EngineView,
    LoadMemory,
    PoolAdmissionState,
    SessionView,
    capacity,
    compaction_pressure,
    retry_after_s,
)
from polykv_engine.policy.prefill import PrefillModel
from polykv_engine.policy.step_time import CeilingCurve, StepCurve


def sess(tps: float, task: int = 0, warming: bool = False, decoded: int = 100,
         in_pool: bool = True, ctx: int = 300, private: int = 100) -> SessionView:  # fmt: skip
    return SessionView(task, True, warming, tps, decoded, in_pool, ctx, private)


def view(
    *sessions: SessionView,
    free: int = 10_000,
    total: int = 16_384,
    steps: StepCurve | None = None,
    pause_aware: bool = True,
    cycles: StepCurve | None = None,
    ceiling: CeilingCurve = "cycle",
) -> EngineView:
    return EngineView(
        tuple(sessions), free, total, 8192, idle_slots=4, pool_prefix_len=200,
        step_curve=steps or StepCurve(), cycle_curve=cycles or StepCurve(),
        pause_aware=pause_aware, ceiling_curve=ceiling,
    )  # fmt: skip


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
    # Its rate was measured alone; with the warming one and one more, three share it.
    assert cap.projected_mean_tps_model == pytest.approx(20 / 3)


def curve(*points: tuple[int, float]) -> StepCurve:
    return StepCurve(tuple(points))


def paused(in_pool: bool = True) -> SessionView:
    """A session in a tool call: its turn ended a moment ago, it will be back."""
    return SessionView(None, False, False, 16.0, 0, in_pool, 300, 100, returning=True)


def test_courier_run_settles_and_projects_from_the_measured_step_curve() -> None:
    """§14.1: the courier run went 38 → 31.7 → 21.7 → 15.9 → 11.6 tps as it admitted
    workers against a floor of 15, because (1) it re-admitted before the EWMA absorbed the
    last admit and (2) nothing learned what an admit really costs.

    The settle window blocks (1); for (2) the engine's step-time curve, measured at the sizes
    the run went through, projects each admit: it admits the sessions that stayed above the
    floor (down to 15.9) and refuses the one that took the real run to 11.6."""
    policy = AdmissionPolicy(
        target_tps_per_session=15.0, mode="enforced", settle_tokens=48, settle_max_ms=5000
    )
    # Step times that give exactly the run's rates: t(b) = 1 / rate(b).
    rates = {1: 38.0, 2: 31.7, 3: 21.7, 4: 15.9, 5: 11.6}
    measured: list[tuple[int, float]] = [(1, 1 / 38.0)]
    st = PoolAdmissionState()
    t = 0.0
    sessions = [sess(38.0, task=1)]
    for step in range(3):
        # Before the curve has two sizes the model assumes a flat aggregate (cautious).
        v = view(*sessions, steps=curve(*measured))
        cap = capacity(policy, st, v, now=t)
        if step == 0:
            assert cap.projected_mean_tps_measured is None
            assert cap.projected_mean_tps_model == pytest.approx(19.0)
        assert cap.can_admit, (step, cap)
        st.record_admit(task_id=step + 2, now=t)
        # Stale EWMA: a tick later nothing has moved yet; the gate must say "settling".
        t += 1.0
        assert capacity(policy, st, view(*sessions), now=t).reason == REASON_SETTLING
        # The admitted session decodes its 48 tokens; everyone slows to the new rate.
        n = len(sessions) + 1
        sessions = [sess(rates[n], task=i + 1) for i in range(n)]
        measured.append((n, 1 / rates[n]))
        t += 2.0
        assert st.update(policy, view(*sessions), now=t)
        assert st.settle is None
    # The fifth session: the curve's line through the measured sizes forecasts the drop.
    cap = capacity(policy, st, view(*sessions, steps=curve(*measured)), now=t)
    t5 = curve(*measured).time_at(5)
    assert t5 is not None and t5 > 1 / 15.9
    assert cap.projected_mean_tps_measured == pytest.approx(15.9 * (1 / 15.9) / t5)
    assert cap.drop_per_admit_ewma == pytest.approx(15.9 - cap.projected_mean_tps_measured)
    assert not cap.can_admit and cap.reason == REASON_FLOOR


def test_settle_closes_on_tokens_or_timeout_never_on_a_short_turn() -> None:
    policy = AdmissionPolicy(target_tps_per_session=5.0, settle_tokens=48, settle_max_ms=1000)
    st = PoolAdmissionState()
    st.record_admit(7, now=0.0)
    assert not st.update(policy, view(sess(30, task=1), sess(0, task=7, decoded=3)), now=0.5)
    assert st.settle_remaining_ms(policy, 0.5) == pytest.approx(500)
    # The admitted turn ended before 48 tokens: the mean without it says nothing yet.
    assert not st.update(policy, view(sess(30, task=1)), now=0.9)
    assert st.update(policy, view(sess(30, task=1)), now=1.0)  # timed out
    st.record_admit(8, now=2.0)
    assert st.update(policy, view(sess(25, task=1), sess(25, task=8, decoded=48)), now=2.2)


def test_a_partly_paused_engine_is_judged_with_everyone_back() -> None:
    # One of two agents is in a tool call: the other alone reads 30 tok/s at b = 1.
    steps = curve((1, 1 / 30), (2, 1 / 20), (3, 1 / 14))
    cap = capacity(FLOOR15, PoolAdmissionState(), view(sess(30.0), paused(), steps=steps), 0)
    # Admitting makes three decoding together: 30 x t(1) / t(3) = 14.
    assert cap.projected_mean_tps_measured == pytest.approx(14.0)
    assert cap.projected_mean_tps_model == pytest.approx(10.0)  # flat aggregate 30 / 3
    assert not cap.can_admit and cap.reason == REASON_FLOOR
    # Paused sessions of other pools load the engine as much as this pool's own.
    other = capacity(
        FLOOR15, PoolAdmissionState(), view(sess(30.0), paused(in_pool=False), steps=steps), 0
    )
    assert other.projected_mean_tps_measured == pytest.approx(14.0)
    # Without pause awareness only the live decoder counts: 30 x t(1) / t(2) = 20 (admit).
    live = view(sess(30.0), paused(), steps=steps, pause_aware=False)
    cap = capacity(FLOOR15, PoolAdmissionState(), live, 0)
    assert cap.projected_mean_tps_if_admitted == pytest.approx(20.0) and cap.can_admit


def test_a_session_long_gone_is_not_returning() -> None:
    steps = curve((1, 1 / 30), (2, 1 / 20), (3, 1 / 14))
    gone = SessionView(None, False, False, 16.0, 0, True, 300, 100, returning=False)
    cap = capacity(FLOOR15, PoolAdmissionState(), view(sess(30.0), gone, steps=steps), 0)
    assert cap.projected_mean_tps_measured == pytest.approx(20.0) and cap.can_admit


def test_guarantee_admits_the_first_session_even_when_saturated() -> None:
    v = view(sess(1.0, in_pool=False), sess(1.0, in_pool=False), free=0)
    cap = capacity(FLOOR15, PoolAdmissionState(), v, now=0)
    assert cap.can_admit and cap.guaranteed and cap.reason == REASON_GUARANTEED
    # ...but never past the context arm: cells are physical.
    cap = capacity(FLOOR15, PoolAdmissionState(), v, now=0, expected_tokens=10)
    assert not cap.can_admit and cap.reason == REASON_CONTEXT


def test_a_session_admitted_but_not_yet_seated_uses_up_the_guarantee() -> None:
    # Two spawns arrive together: the first is admitted on the guarantee but has no slot
    # yet; the second must not be "the first" too.
    state = PoolAdmissionState()
    saturated = view(sess(1.0, in_pool=False), free=0)
    assert capacity(FLOOR15, state, saturated, now=0).guaranteed
    state.record_admit(task_id=7, now=0)
    cap = capacity(FLOOR15, state, saturated, now=0.1)
    assert not cap.can_admit and not cap.guaranteed and cap.reason == REASON_SETTLING
    # On its slot it is counted by the view, not twice.
    seated = view(sess(1.0, task=7), free=0)
    assert capacity(FLOOR15, state, seated, now=0.2).reason == REASON_SETTLING
    assert state.n_seating(seated) == 0
    # A request that ended before it was seated frees the guarantee again.
    other = PoolAdmissionState()
    other.record_admit(task_id=8, now=0)
    other.forget(8)
    assert capacity(FLOOR15, other, saturated, now=0.1).guaranteed


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
    memory = LoadMemory()
    steps = curve((1, 1 / 30), (2, 1 / 20), (3, 1 / 16), (4, 1 / 12))
    memory.observe(view(sess(16.0), sess(16.0), sess(16.0)), now=100.0)
    # Every agent is in a tool call: no live rate, but one measured 10 s ago at b = 3.
    v = view(paused(), paused(), paused(), steps=steps)
    cap = capacity(FLOOR15, PoolAdmissionState(), v, now=110.0, memory=memory)
    assert cap.projected_idle_estimate
    assert cap.projected_mean_tps_if_admitted == pytest.approx(16.0 * (1 / 16) / (1 / 12))
    assert cap.projected_mean_tps_model == pytest.approx(16.0 * 3 / 4)
    assert cap.reason == REASON_FLOOR_IDLE
    stale = capacity(FLOOR15, PoolAdmissionState(), v, now=200.0, memory=memory)
    assert not stale.projected_idle_estimate and stale.can_admit  # 100 s old: says nothing
    # Sessions long gone: nothing returns, so the engine is free whatever it measured.
    gone = SessionView(None, False, False, 16.0, 0, True, 300, 100, returning=False)
    cap = capacity(FLOOR15, PoolAdmissionState(), view(gone, gone), now=110.0, memory=memory)
    assert cap.can_admit and cap.projected_mean_tps_if_admitted is None


def test_warming_sessions_do_not_refresh_the_memory() -> None:
    memory = LoadMemory()
    memory.observe(view(sess(20.0), sess(0.0, warming=True)), now=5.0)
    assert not memory.fresh(5.0)
    memory.observe(view(sess(20.0), sess(18.0)), now=6.0)
    assert memory.fresh(6.0) and memory.mean == pytest.approx(19.0) and memory.n_decoding == 2


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
    st.record_admit(1, now=0.0)
    cap = capacity(FLOOR15, st, view(sess(30)), now=1.2)
    assert cap.settling and retry_after_s(cap, FLOOR15) == 4
    cap = capacity(FLOOR15, PoolAdmissionState(), view(sess(1), sess(1)), now=0)
    assert retry_after_s(cap, FLOOR15) == 5


def test_without_pause_awareness_an_idle_moment_still_uses_the_memory() -> None:
    memory = LoadMemory()
    memory.observe(view(sess(16.0), sess(16.0)), now=100.0)
    v = view(paused(), paused(), pause_aware=False)
    cap = capacity(FLOOR15, PoolAdmissionState(), v, now=101.0, memory=memory)
    # The two it was measured with come back, plus one: 16 x 2 / 3.
    assert cap.projected_idle_estimate
    assert cap.projected_mean_tps_if_admitted == pytest.approx(16.0 * 2 / 3)
    assert cap.reason == REASON_FLOOR_IDLE


STEPS = curve((4, 0.010), (5, 0.0115), (6, 0.0132))  # t(b): 1.15x from five to six
FLOOR40 = AdmissionPolicy(target_tps_per_session=40.0, mode="enforced", guarantee_min_sessions=1)


def five(tps: float) -> EngineView:
    return view(*(sess(tps, task=i) for i in range(5)), steps=STEPS)


def test_a_lucky_reading_does_not_admit_when_the_window_says_otherwise() -> None:
    # Five agents typically read 45 tok/s (45 / 1.15 = 39 with a sixth: under the floor),
    # and right after a tool call pause the live mean reads 54 (54 / 1.15 = 47: over it).
    memory = LoadMemory()
    for i in range(50):  # ten seconds of readings at the typical rate
        memory.observe(five(45.0), now=i * 0.2)
    lucky = five(54.0)
    alone = capacity(FLOOR40, PoolAdmissionState(), lucky, now=10.0)
    assert alone.can_admit and alone.projected_mean_tps_if_admitted == pytest.approx(
        54 / 1.148, 1e-3
    )
    cap = capacity(FLOOR40, PoolAdmissionState(), lucky, now=10.0, memory=memory)
    assert not cap.can_admit and cap.reason == REASON_FLOOR
    assert cap.projected_mean_tps_if_admitted == pytest.approx(45 * 0.0115 / 0.0132)
    # Readings at other sizes count too, each scaled by the curve from its own size.
    memory = LoadMemory()
    for i in range(50):
        memory.observe(view(*(sess(52.0, task=i) for i in range(4)), steps=STEPS), now=i * 0.2)
    cap = capacity(FLOOR40, PoolAdmissionState(), lucky, now=10.0, memory=memory)
    assert cap.projected_mean_tps_if_admitted == pytest.approx(52 * 0.010 / 0.0132)


def test_a_real_drop_shows_at_once_and_old_readings_leave_the_window() -> None:
    memory = LoadMemory()
    for i in range(50):
        memory.observe(five(60.0), now=i * 0.2)
    slow = five(44.0)  # the live reading drops below what the window remembers
    cap = capacity(FLOOR40, PoolAdmissionState(), slow, now=10.0, memory=memory)
    assert cap.projected_mean_tps_if_admitted == pytest.approx(44 * 0.0115 / 0.0132)
    assert not cap.can_admit
    # Readings older than the window are forgotten: a fast reading now stands alone
    # (fewer than the minimum in the window) once they are gone.
    memory.observe(five(60.0), now=30.0)
    assert len(memory.readings) == 1
    cap = capacity(FLOOR40, PoolAdmissionState(), five(60.0), now=30.0, memory=memory)
    assert cap.can_admit and cap.projected_mean_tps_if_admitted == pytest.approx(
        60 * 0.0115 / 0.0132
    )


def test_warming_or_idle_moments_add_no_readings() -> None:
    memory = LoadMemory()
    memory.observe(view(sess(50.0), sess(0.0, warming=True), steps=STEPS), now=0.0)
    memory.observe(view(paused(), steps=STEPS), now=0.1)
    assert not memory.readings


def test_a_rate_earned_while_others_paused_is_capped_by_the_step_time() -> None:
    """The spawn ramp's over-admit: five agents read 51 tok/s right after tool-call pauses
    (their 2 s EWMAs were earned with fewer decoding), where a step of six takes 35.2 ms.
    Scaling 51 by t(5) / t(6) says 41.6 and clears a floor of 31.4; no session can get more
    than one token per step, 1 / t(6) = 28.4, which does not."""
    steps = curve((4, 0.0250), (5, 0.0287), (6, 0.0352))
    floor = AdmissionPolicy(target_tps_per_session=31.4, mode="enforced")
    cap = capacity(floor, PoolAdmissionState(), view(*(sess(51.0, task=i) for i in range(5)),
                   steps=steps), now=0)  # fmt: skip
    assert cap.projected_mean_tps_if_admitted == pytest.approx(1 / 0.0352)
    assert not cap.can_admit and cap.reason == REASON_FLOOR
    # The ceiling only ever lowers a projection: four agents at the rate the curve allows
    # project the curve's own rate for five, and are admitted.
    four = view(*(sess(40.0, task=i) for i in range(4)), steps=steps)
    cap = capacity(floor, PoolAdmissionState(), four, now=0)
    assert cap.projected_mean_tps_if_admitted == pytest.approx(40.0 * 0.0250 / 0.0287)
    assert cap.can_admit


def test_the_cap_reads_token_to_token_times_which_hold_the_prompt_work_agents_bring_back() -> None:
    """The 2026-12-01 ramp's overshoot: four agents read 27.1 each and a fifth was admitted
    at a projection of 22.1 against a floor of 21.9, where five then got 19.5. Decode-only
    steps priced the fifth at +2.8 ms a step; the time between two tokens, prompt chunks of
    the agents' returning turns included, grew by 4-11 ms an agent up to four, and its line
    puts five at 50.3 ms: 19.9 tok/s, under the floor."""
    steps = curve((1, 0.0199), (2, 0.0258), (3, 0.0337), (4, 0.0382), (5, 0.0410))
    cycles = curve((1, 0.0172), (2, 0.0280), (3, 0.0368), (4, 0.0405))
    four = [sess(27.1, task=i) for i in range(4)]
    floor = AdmissionPolicy(target_tps_per_session=21.9, mode="enforced")

    def decide(ceiling: CeilingCurve, with_cycles: bool = True) -> Capacity:
        v = view(*four, steps=steps, cycles=cycles if with_cycles else None, ceiling=ceiling)
        return capacity(floor, PoolAdmissionState(), v, now=0)

    cap = decide("cycle")
    slope, intercept = 0.007870, 0.010950  # the least-squares line through the four cycles
    assert cap.projected_mean_tps_if_admitted == pytest.approx(1 / (intercept + 5 * slope))
    assert not cap.can_admit and cap.reason == REASON_FLOOR
    # Capped by decode-only steps (or before any cycle is timed): 1 / t(5) = 24.4 admits.
    for cap in (decide("step"), decide("cycle", with_cycles=False)):
        assert cap.projected_mean_tps_if_admitted == pytest.approx(1 / 0.0410)
        assert cap.can_admit
    # No cap: the reading scaled by the curve alone, 27.1 × t(4) / t(5).
    assert decide("none").projected_mean_tps_if_admitted == pytest.approx(27.1 * 0.0382 / 0.0410)


def test_no_cap_lets_a_rate_earned_while_others_paused_through() -> None:
    steps = curve((4, 0.0250), (5, 0.0287), (6, 0.0352))
    five = [sess(51.0, task=i) for i in range(5)]
    floor = AdmissionPolicy(target_tps_per_session=31.4, mode="enforced")
    capped = capacity(floor, PoolAdmissionState(), view(*five, steps=steps), now=0)
    uncapped = capacity(
        floor, PoolAdmissionState(), view(*five, steps=steps, ceiling="none"), now=0
    )
    assert not capped.can_admit
    assert uncapped.projected_mean_tps_if_admitted == pytest.approx(51.0 * 0.0287 / 0.0352)
    assert uncapped.can_admit


def prompt_work(pending: int, model: PrefillModel, *sessions: SessionView) -> EngineView:
    """Sessions decoding at 20 ms a step (one and two measured) with ``pending`` prompt
    tokens promised."""
    v = view(*sessions, steps=curve((1, 0.02), (2, 0.02)))
    return replace(v, prefill_pending=pending, prefill=model, n_batch=2048)


def test_promised_prompt_work_that_would_dip_under_the_floor_holds_a_new_session() -> None:
    floor5 = AdmissionPolicy(target_tps_per_session=5.0, mode="enforced")
    running = sess(40.0, task=1)
    # A fixed budget of 512 tokens at 3 ms each: steps of ~1.5 s, 0.65 tok/s while it runs.
    fixed = PrefillModel(fixed_budget=512, token_s=0.003)
    cap = capacity(floor5, PoolAdmissionState(), prompt_work(1900, fixed, running), now=0)
    assert not cap.can_admit and cap.reason == REASON_PREFILL and cap.reason_code == "prefill"
    assert cap.prefill_pending_tokens == 1900
    assert cap.projected_prefill_tps == pytest.approx(1 / (0.02 + 512 * 0.003))
    # Paced at the pool's own floor, the prompt keeps it: admitted.
    paced = PrefillModel(token_s=0.003)
    cap = capacity(floor5, PoolAdmissionState(), prompt_work(1900, paced, running), now=0)
    assert cap.can_admit and cap.projected_prefill_tps is not None
    assert cap.projected_prefill_tps >= 5.0
    # Nothing promised: no dip to price.
    cap = capacity(floor5, PoolAdmissionState(), prompt_work(0, fixed, running), now=0)
    assert cap.can_admit and cap.projected_prefill_tps is None and cap.prefill_pending_tokens == 0


def test_unpaced_prompt_work_counts_its_whole_step() -> None:
    # No floor anywhere and no fixed budget: the 1,900-token prompt rides one ~5.7 s step.
    model = PrefillModel(token_s=0.003)
    cap = capacity(None, PoolAdmissionState(), prompt_work(1900, model, sess(40.0)), now=0)
    assert cap.projected_prefill_tps == pytest.approx(1 / (0.02 + 1900 * 0.003))
    assert cap.can_admit  # no policy, no floor to hold for
