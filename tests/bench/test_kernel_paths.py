"""The analysis of the kernel-paths benchmark (bench/kernel_paths.py): ratios paired per
repetition, token identity counted per pair, the CPU and the paths named in the table."""

from __future__ import annotations

from typing import Any

import pytest

from bench.kernel_paths import Config, analyse, render

MODEL = "m"


def run(rep: int, k: int, server: str, tps: float, tokens: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "rep": rep, "k": k, "server": server, "decode_tps": tps,
            "tokens": [tokens], "foreign_cpu_cores": 0.1}  # fmt: skip


def raw() -> dict[str, Any]:
    runs = []
    # Rep 0: on 120, off 100, llama-server 100; rep 1: the machine twice as fast for all.
    for rep, scale in ((0, 1.0), (1, 2.0)):
        runs += [
            run(rep, 2, "llama_server", 100 * scale, [1, 2, 3]),
            run(rep, 2, "polykv", 120 * scale, [1, 2, 3]),
            run(rep, 2, "polykv_ggml", 100 * scale, [1, 2, 3] if rep == 0 else [1, 2, 4]),
        ]
    return {
        "env": {"cpu": "Test CPU 9000", "cpu_count": 2, "git_commit": "abc", "date_utc": "now"},
        "llama_server": {"version": "1 (x)"},
        "cpu_variant": "zen4",
        "kernel_paths": {MODEL: {"polykv": ["q6_K_cols"], "polykv_ggml": []}},
        "runs": runs,
    }


def test_ratios_are_paired_per_repetition_and_tokens_compared_per_pair() -> None:
    cfg = Config(reps=2, models=(MODEL,), levels=(2,))
    row = analyse(cfg, raw())[MODEL]["2"]
    # Paired, the drift cancels: 1.2 both times (unpaired medians would say the same here,
    # but the spread of each column is 2x).
    assert row["polykv/polykv_ggml"]["values"] == pytest.approx([1.2, 1.2])
    assert row["polykv/llama_server"]["median"] == pytest.approx(1.2)
    assert row["polykv_ggml/llama_server"]["median"] == pytest.approx(1.0)
    assert (row["same_tokens_paths"], row["same_tokens_upstream"], row["reps"]) == (1, 2, 2)


def test_the_table_names_the_cpu_the_variant_and_the_paths() -> None:
    cfg = Config(reps=2, models=(MODEL,), levels=(2,))
    data = raw()
    table = render(cfg, data, analyse(cfg, data))
    assert "Test CPU 9000" in table and "variant zen4" in table
    assert "(paths on: q6_K_cols)" in table
    assert "| 2 | 150 (100–200) | 180 (120–240) | 150 (100–200) | 1.20× (1.20–1.20) |" in table


def test_the_table_says_whether_the_gate_or_the_run_chose_the_paths() -> None:
    data = raw()
    for on, said in ((None, "its gate picks for this CPU"), ("all", "`POLYKV_GGML_PATHS=all`")):
        cfg = Config(reps=2, models=(MODEL,), levels=(2,), on=on)
        assert said in render(cfg, data, analyse(cfg, data))
