import pytest

from polykv_engine.policy.tps import ActiveRates, SessionRate, ThroughputRate, active_rates


def test_session_rate_is_exact_for_a_steady_stream() -> None:
    r = SessionRate()
    for i in range(50):
        r.on_token(i * 0.1)
    assert r.tps == pytest.approx(10.0)


def test_session_rate_warms_until_two_tokens() -> None:
    r = SessionRate()
    assert r.warming and r.tps == 0.0
    r.on_token(1.0)
    assert r.warming and r.tps == 0.0
    r.on_token(1.5)
    assert not r.warming and r.tps == pytest.approx(2.0)


def test_session_rate_follows_a_slowdown_within_a_few_windows() -> None:
    r = SessionRate(window_tokens=128, window_s=2.0)
    t = 0.0
    for _ in range(400):
        t += 0.01  # 100 tps
        r.on_token(t)
    for _ in range(300):
        t += 0.02  # 50 tps for 6 s = three time windows
        r.on_token(t)
    # The old rate keeps a weight of about exp(-3) of the time mass: a few percent.
    assert r.tps == pytest.approx(50.0, rel=0.05)


def test_session_rate_token_window_bounds_memory_for_fast_streams() -> None:
    r = SessionRate(window_tokens=128, window_s=2.0)
    t = 0.0
    for _ in range(1000):
        t += 0.001  # 1000 tps
        r.on_token(t)
    for _ in range(384):  # three token windows at 500 tps
        t += 0.002
        r.on_token(t)
    assert r.tps == pytest.approx(500.0, rel=0.05)


def test_reset_starts_a_new_turn() -> None:
    r = SessionRate()
    r.on_token(0.0)
    r.on_token(0.1)
    r.reset()
    assert r.warming and r.n_tokens == 0


def test_throughput_converges_and_decays_to_zero_when_idle() -> None:
    th = ThroughputRate(tau_s=1.0)
    t = 0.0
    for _ in range(2000):
        t += 0.005
        th.add(1, t)  # 200 tokens/s
    assert th.rate(t) == pytest.approx(200.0, rel=0.02)
    assert th.rate(t + 10.0) < 0.01
    assert th.total == 2000


def test_throughput_ignores_time_going_backwards() -> None:
    th = ThroughputRate(tau_s=1.0)
    th.add(10, 5.0)
    assert th.rate(4.0) == pytest.approx(10.0)


def test_mean_active_tps_excludes_warming_and_idle_sessions() -> None:
    # (decoding, warming, tps): a warming session is counted apart, never averaged as 0.
    rates = active_rates([(True, False, 10.0), (True, True, 0.0), (True, False, 20.0)])
    assert (rates.n_active, rates.n_warming, rates.mean) == (2, 1, pytest.approx(15.0))
    # between turns (not decoding) a session keeps its last rate but is not active
    assert active_rates([(False, False, 30.0), (True, False, 10.0)]).mean == 10.0
    assert active_rates([(True, False, 0.0)]) == ActiveRates(0, 1, 0.0)
    assert active_rates([]).mean == 0.0


def test_replicas_combine_by_sums_not_by_averaging_means() -> None:
    a = active_rates([(True, False, 10.0)] * 3)  # mean 10 over 3 sessions
    b = active_rates([(True, False, 40.0)])  # mean 40 over 1
    assert (a + b).mean == pytest.approx(70.0 / 4)  # not (10 + 40) / 2
