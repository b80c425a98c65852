"""The decode step-time curve admission scales rates with."""

from __future__ import annotations

import pytest

from polykv_engine.policy.step_time import StepCurve, StepTimer


def test_a_size_counts_only_after_enough_steps() -> None:
    timer = StepTimer(min_steps=4)
    for _ in range(3):
        timer.record(1, 0.020)
    assert timer.curve().points == ()
    timer.record(1, 0.020)
    assert timer.curve().points == ((1, pytest.approx(0.020)),)
    timer.record(0, 1.0)  # nothing decoded: ignored
    timer.record(2, -1.0)
    assert len(timer.curve().points) == 1


def test_the_first_steps_average_then_the_ewma_follows() -> None:
    timer = StepTimer(alpha=0.1, min_steps=1)
    timer.record(2, 0.100)  # a slow first step (a cold cache) ...
    timer.record(2, 0.020)
    assert timer.curve().time_at(2) == pytest.approx(0.060)  # ... is averaged, not kept
    for _ in range(200):
        timer.record(2, 0.030)
    assert timer.curve().time_at(2) == pytest.approx(0.030, rel=1e-3)


def test_one_size_assumes_a_flat_aggregate() -> None:
    c = StepCurve(((2, 0.040),))
    assert not c.measured
    assert c.time_at(4) == pytest.approx(0.080)
    assert c.scale(25.0, 2, 4) == pytest.approx(12.5)
    assert StepCurve().time_at(3) is None and StepCurve().scale(10.0, 1, 2) is None


def test_a_line_through_the_sizes_extrapolates_and_never_falls() -> None:
    c = StepCurve(((1, 0.017), (2, 0.030), (3, 0.035)))
    assert c.measured
    assert c.time_at(2) == pytest.approx(0.030)  # measured sizes are taken as measured
    t4 = c.time_at(4)
    assert t4 is not None and t4 == pytest.approx(0.082 / 3 - 0.009 * 2 + 0.009 * 4)  # the fit
    assert t4 > 0.035
    # A noisy curve whose line dips below a smaller size's time is held at that time.
    noisy = StepCurve(((1, 0.010), (3, 0.050), (4, 0.030)))
    t5 = noisy.time_at(5)
    assert t5 is not None and t5 >= 0.050
    # Below the smallest measured size: no faster than its aggregate rate allows.
    gpu = StepCurve(((4, 0.020), (8, 0.022)))
    t1 = gpu.time_at(1)
    assert t1 is not None and t1 >= 0.020 / 4
    assert gpu.scale(45.0, 8, 9) == pytest.approx(45.0 * 0.022 / gpu.time_at(9))  # type: ignore[operator]


def test_a_size_not_seen_for_a_while_leaves_the_curve_and_starts_over() -> None:
    """A gate that keeps the load below a size never visits it again: a high reading there
    must not refuse forever. The cycle timer drops sizes unseen for ``fresh_s``."""
    timer = StepTimer(alpha=0.1, min_steps=2, fresh_s=30.0)
    for t in (0.0, 0.1):
        timer.record(3, 0.090, now=t)  # a bad minute at 3 sessions
        timer.record(2, 0.030, now=t)
    assert dict(timer.curve(now=10.0).points) == {2: 0.030, 3: 0.090}
    for t in range(11, 60):
        timer.record(2, 0.030, now=float(t))  # the load stays at 2
    assert dict(timer.curve(now=60.0).points) == {2: 0.030}  # 3 is gone, 2 is kept
    # Back at 3: the old readings are not averaged in; it counts again after min_steps.
    timer.record(3, 0.040, now=61.0)
    assert 3 not in dict(timer.curve(now=61.0).points)
    timer.record(3, 0.040, now=61.1)
    assert dict(timer.curve(now=61.1).points)[3] == pytest.approx(0.040)
    # The decode-only timer keeps every size (no fresh_s).
    plain = StepTimer(min_steps=1)
    plain.record(4, 0.050, now=0.0)
    assert plain.curve(now=1e6).points == ((4, 0.050),)
