"""The session accounting of the end-to-end agent benchmark (bench/agent_timeline.py)."""

from __future__ import annotations

import pytest

from bench.agent_timeline import (
    TurnTimes,
    mean_tps_series,
    needs_compaction,
    under_floor_by_session,
)


def test_only_gaps_longer_than_the_floor_period_count_whole() -> None:
    # Floor 5 tok/s: period 0.2 s. Gaps 0.1, 0.3, 0.1, 2.0: the 0.3 and the 2.0 count whole.
    turn = TurnTimes("w", sent=0.0, tokens=(1.0, 1.1, 1.4, 1.5, 3.5))
    assert turn.under_floor_s(5.0) == pytest.approx(2.3)
    assert turn.largest_gap_s() == pytest.approx(2.0)
    assert turn.first_token_s == pytest.approx(1.0)  # its own prompt: not under the floor


def test_a_single_token_turn_has_no_gap() -> None:
    turn = TurnTimes("w", sent=0.5, tokens=(2.0,))
    assert turn.under_floor_s(5.0) == 0.0
    assert turn.largest_gap_s() == 0.0
    assert turn.rate_at(2.0) is None


def test_under_floor_is_summed_per_session_over_its_turns() -> None:
    turns = [
        TurnTimes("a", 0.0, (0.0, 1.0)),  # 1.0 s gap
        TurnTimes("b", 0.0, (0.0, 0.1, 0.2)),  # never under
        TurnTimes("a", 5.0, (5.0, 5.5)),  # 0.5 s gap
    ]
    assert under_floor_by_session(turns, 5.0) == pytest.approx({"a": 1.5, "b": 0.0})


def test_the_rate_at_an_instant_is_one_over_the_gap_it_falls_in() -> None:
    turn = TurnTimes("w", 0.0, (1.0, 1.5, 3.5))
    assert turn.rate_at(0.9) is None  # waiting for its first token: not decoding
    assert turn.rate_at(1.0) == pytest.approx(2.0)
    assert turn.rate_at(2.0) == pytest.approx(0.5)
    assert turn.rate_at(3.5) is None  # its last token: done


def test_the_series_averages_the_turns_decoding_at_each_sample() -> None:
    turns = [TurnTimes("a", 0.0, (0.0, 0.5, 1.0)), TurnTimes("b", 0.0, (0.5, 0.75, 1.0))]
    series = mean_tps_series(turns, 1.0, 0.5)
    assert [s[0] for s in series] == [0.0, 0.5, 1.0]
    assert series[0][1:] == (pytest.approx(2.0), 1)  # a alone at 2 tok/s
    assert series[1][1:] == (pytest.approx(3.0), 2)  # a at 2, b at 4
    assert series[2][1:] == (None, 0)  # both done


def test_the_series_needs_a_positive_step() -> None:
    with pytest.raises(ValueError, match="step_s"):
        mean_tps_series([], 1.0, 0.0)


def test_a_history_is_compacted_once_it_grows_past_its_budget() -> None:
    assert not needs_compaction(context_tokens=1600, first_prompt_tokens=1000, budget_tokens=600)
    assert needs_compaction(context_tokens=1601, first_prompt_tokens=1000, budget_tokens=600)
