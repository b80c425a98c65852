"""The end-to-end agent benchmark's content: the same for every server and every run."""

from __future__ import annotations

from bench.agent_crew import (
    NAME,
    TOOLS,
    Config,
    called_tool,
    result_name,
    step_text,
    tool_pause,
    tool_result,
)


def test_a_call_names_its_tool_even_when_cut_short() -> None:
    assert called_tool('{"tool": "run_tests", "argument": "auth"}') == "run_tests"
    assert called_tool('{\n  "tool": "search_code",\n  "argu') == "search_code"  # max_tokens
    assert called_tool('{"tool": "rm_rf", "argument": "/"}') == TOOLS[0]  # no such tool


def test_steps_tool_results_and_pauses_are_fixed_by_round_and_worker() -> None:
    cfg = Config()
    assert step_text(2, 5) == step_text(2, 5)
    assert step_text(2, 5) != step_text(2, 6)
    # The result does not depend on what a server's model chose to call, beyond its name.
    read, run = (tool_result(cfg, 1, 3, t).split("\n", 1) for t in ("read_file", "run_tests"))
    assert read[0] != run[0]
    assert read[1] == run[1]
    assert cfg.tool_pause_s[0] <= tool_pause(cfg, 1, 3) <= cfg.tool_pause_s[1]
    assert tool_pause(cfg, 1, 3) == tool_pause(cfg, 1, 3)


def test_each_model_publishes_a_table_of_its_own() -> None:
    # The front page reads the default model's results; another model's stand beside them.
    assert result_name(Config.model) == NAME
    assert result_name("gemma-3-270m-q4_k_m") == f"{NAME}_gemma_3_270m_q4_k_m"
