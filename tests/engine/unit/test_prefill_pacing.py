"""Prompt pacing (policy.prefill) against hand-computed budgets."""

from __future__ import annotations

import pytest

from polykv_engine.policy.prefill import (
    AIM,
    FEWEST_ROWS,
    FIRST_CHUNK,
    LOOP_ALPHA,
    MIN_CHUNK,
    STRETCH,
    PrefillModel,
    PrefillPacer,
)

CAP = 2044  # a 2048-token batch beside four decoding sessions


def test_without_a_floor_or_a_fixed_budget_a_step_takes_what_the_batch_holds() -> None:
    pacer = PrefillPacer()
    pacer.record(1000, 3.0, None)
    assert pacer.budget(None, 0.02, CAP) == CAP


def test_a_fixed_budget_is_the_budget_whatever_the_floor() -> None:
    pacer = PrefillPacer(fixed_budget=256)
    assert pacer.budget(None, 0.02, CAP) == 256
    assert pacer.budget(0.2, 0.02, CAP) == 256
    assert pacer.budget(0.2, 0.02, 100) == 100  # never more than the batch holds


def test_the_first_chunk_is_small_until_a_prompt_step_was_timed() -> None:
    assert PrefillPacer().budget(0.2, 0.02, CAP) == FIRST_CHUNK


def test_the_budget_fills_the_floor_period_beside_the_decode_step() -> None:
    pacer = PrefillPacer()
    # 40 prompt tokens beside a 20 ms decode step took 140 ms: 3 ms a prompt token.
    pacer.record(40, 0.14, 0.02)
    assert pacer.model.token_s == pytest.approx(0.003)
    # A 5 tok/s floor: 200 ms between tokens; step and loop aim at AIM periods.
    expected = int((AIM * 0.2 - 0.02) / 0.003)
    assert pacer.budget(0.2, 0.02, CAP) == expected
    # Eight sessions' slower decode step leaves less room for the prompt.
    assert pacer.budget(0.2, 0.05, CAP) == int((AIM * 0.2 - 0.05) / 0.003)


def test_the_per_token_cost_follows_a_prompt_that_grows_dearer() -> None:
    pacer = PrefillPacer()
    pacer.record(40, 0.14, 0.02)  # 3 ms
    pacer.record(40, 0.26, 0.02)  # 6 ms: later in the prompt, every token attends to more
    assert pacer.model.token_s == pytest.approx(0.0045)


def test_a_step_no_slower_than_its_decode_part_does_not_make_the_prompt_free() -> None:
    pacer = PrefillPacer()
    pacer.record(40, 0.02, 0.03)  # noise: the mixed step beat the decode-only estimate
    assert pacer.model.token_s == pytest.approx(0.25 * 0.02 / 40)
    assert pacer.model.token_s is not None and pacer.model.token_s > 0


def test_a_floor_the_decode_step_already_misses_still_lets_the_prompt_in() -> None:
    pacer = PrefillPacer()
    pacer.record(40, 0.42, 0.02)  # 10 ms a prompt token
    # 170 ms aimed at, 160 ms of decoding: the prompt gets as long as the decode step.
    assert pacer.budget(0.2, 0.16, CAP) == 16
    # A machine so busy that the decode step alone takes 640 ms: still 64 tokens a step.
    assert pacer.budget(0.2, 0.64, CAP) == 64
    assert pacer.budget(0.2, 0.001, CAP) == int((AIM * 0.2 - 0.001) / 0.01)
    pacer.record(40, 40.0, 0.02)  # a very slow step: about 0.5 s a token now
    # Even one token stretches the step past the floor: the fewest rows worth a step.
    assert pacer.budget(0.2, 0.02, CAP) == FEWEST_ROWS


def test_deep_in_a_long_prompt_a_chunk_shrinks_to_keep_the_step_near_the_period() -> None:
    pacer = PrefillPacer()
    # 10 ms a prompt token: the aim's room holds 13, so the smallest chunk (16) goes in.
    pacer.record(10, 0.132, 0.032)
    assert pacer.budget(0.2, 0.032, CAP) == MIN_CHUNK
    # 23 ms a token (8,000 tokens in): 16 would hold the decoding sessions 2 periods;
    # the chunk shrinks to what fits in STRETCH periods beside their decode.
    pacer = PrefillPacer()
    pacer.record(10, 0.262, 0.032)
    assert pacer.budget(0.2, 0.032, CAP) == int((STRETCH * 0.2 - 0.032) / 0.023)
    assert 0.032 + pacer.budget(0.2, 0.032, CAP) * 0.023 <= STRETCH * 0.2


def test_the_loop_after_a_paced_step_comes_out_of_the_prompt_share() -> None:
    pacer = PrefillPacer()
    pacer.record(40, 0.14, 0.02)  # 3 ms a prompt token
    pacer.record_loop(0.03)  # the first loop time is taken as it is
    assert pacer.model.loop_s == pytest.approx(0.03)
    assert pacer.budget(0.2, 0.02, CAP) == int((AIM * 0.2 - 0.03 - 0.02) / 0.003)
    pacer.record_loop(0.01)  # then followed with LOOP_ALPHA
    assert pacer.model.loop_s == pytest.approx(0.03 + LOOP_ALPHA * (0.01 - 0.03))
    pacer.record_loop(-1.0)  # a clock that went back is not a loop time
    assert pacer.model.loop_s == pytest.approx(0.03 + LOOP_ALPHA * (0.01 - 0.03))
    # Between two tokens of a decoding session: the step and the loop.
    model = pacer.model
    k = model.budget(0.2, 0.02, CAP)
    assert model.step_s(0.2, 0.02, 5000, CAP) == pytest.approx(
        0.02 + k * model.token_s + model.loop_s  # type: ignore[operator]
    )
    assert model.step_s(0.2, 0.02, 5000, CAP) <= AIM * 0.2


def test_the_tightest_floor_decides_and_sessions_without_one_take_the_default() -> None:
    assert PrefillModel().period_s([None, None]) is None
    assert PrefillModel().period_s([5.0, None, 10.0]) == pytest.approx(0.1)
    assert PrefillModel(default_floor_tps=20.0).period_s([5.0, None]) == pytest.approx(0.05)
    assert PrefillModel().period_s([]) is None


def test_the_step_time_while_prompts_are_paced() -> None:
    model = PrefillModel(token_s=0.003)
    # Paced at a 5 tok/s floor: the step is the budget's, about AIM x the period.
    paced = model.step_s(0.2, 0.02, 5000, CAP)
    assert paced == pytest.approx(0.02 + int((AIM * 0.2 - 0.02) / 0.003) * 0.003)
    assert paced <= AIM * 0.2
    # The decode step alone over the period: the prompt's share is as long again.
    assert model.step_s(0.2, 0.3, 5000, CAP) == pytest.approx(0.3 + 100 * 0.003)
    # A short prompt takes less than the budget.
    assert model.step_s(0.2, 0.02, 10, CAP) == pytest.approx(0.02 + 10 * 0.003)
    # No floor: the whole prompt rides one step, as it did before pacing.
    assert model.step_s(None, 0.02, 1900, CAP) == pytest.approx(0.02 + 1900 * 0.003)
    # A fixed budget of 512: 512 tokens a step.
    fixed = PrefillModel(fixed_budget=512, token_s=0.003)
    assert fixed.step_s(0.2, 0.02, 5000, CAP) == pytest.approx(0.02 + 512 * 0.003)
