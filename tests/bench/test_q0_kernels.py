"""The analysis of the Q8_0/Q5_0 kernel benchmark (bench/q0_kernels.py): speed-ups paired per
repetition, outputs compared per pair, the paths of both processes named."""

from __future__ import annotations

from typing import Any

import pytest

from bench.q0_kernels import SHAPES, Config, analyse, render

SHAPE = SHAPES[0][0]


def run(rep: int, side: str, us: float, sha1: str) -> dict[str, Any]:
    paths = ["q5_0_cols", "q8_0_cols"] if side == "zmm" else []
    return {
        "rep": rep,
        "shape": SHAPE,
        "tokens": 8,
        "side": side,
        "us": us,
        "calls": 10,
        "out_sha1": sha1,
        "paths": paths,
    }


def raw() -> dict[str, Any]:
    # Rep 0: tinyBLAS 30 us, 512-bit 20; rep 1 the machine twice as slow, and the outputs differ.
    runs = [
        run(0, "zmm", 20, "a"),
        run(0, "tinyblas", 30, "a"),
        run(1, "tinyblas", 60, "b"),
        run(1, "zmm", 40, "c"),
    ]
    return {
        "env": {
            "cpu": "Test CPU 9000",
            "cpu_count": 2,
            "git_commit": "abc",
            "date_utc": "now",
            "llama_cpp_python": "0.3.36",
        },
        "paths": {"zmm": ["q5_0_cols", "q8_0_cols"], "tinyblas": []},
        "runs": runs,
    }


def cfg() -> Config:
    return Config(reps=2, tokens=(8,))


def test_speedups_are_paired_and_outputs_compared_per_repetition() -> None:
    row = analyse(cfg(), raw())[f"{SHAPE}|8"]
    assert row["speedup"]["values"] == pytest.approx([1.5, 1.5])
    assert (row["same_bits"], row["pairs"]) == (1, 2)


def test_the_table_names_the_cpu_and_both_sides_paths() -> None:
    data = raw()
    table = render(cfg(), data, analyse(cfg(), data))
    assert "Test CPU 9000" in table
    assert "kernel paths q5_0_cols, q8_0_cols" in table and "every path off (none on)" in table
    assert f"| {SHAPE} | 8 | 45 (30–60) | 30 (20–40) | 1.50× (1.50–1.50) | 1/2 |" in table
