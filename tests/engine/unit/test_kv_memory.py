"""kv.memory: the kind of memory a model keeps, and the arithmetic of its rules (pure)."""

from __future__ import annotations

import pytest

from polykv_engine.kv.memory import (
    Memory,
    save_spans,
    window_cache_cells,
    window_joins,
    window_kept,
)


@pytest.mark.parametrize(
    ("recurrent", "hybrid", "n_swa", "kind", "exact", "guarded"),
    [
        (False, False, 0, "attention", False, False),
        (False, False, 512, "sliding_window", False, True),
        (True, False, 0, "recurrent", True, False),
        (False, True, 0, "hybrid", True, False),
        (False, True, 128, "hybrid", True, False),  # a hybrid's rules are the recurrent ones
    ],
)
def test_kinds_and_their_rules(
    recurrent: bool, hybrid: bool, n_swa: int, kind: str, exact: bool, guarded: bool
) -> None:
    m = Memory.of(recurrent, hybrid, n_swa)
    assert (m.kind, m.exact_length, m.guarded) == (kind, exact, guarded)
    assert m.plain == (kind == "attention")
    summary = m.pools_summary()
    assert ("recurrent_attach" in summary) == exact
    assert ("guard sequence" in summary) == guarded


def test_window_cache_cells_is_llama_cpps_size() -> None:
    # n_swa x sequences + a micro-batch, padded to 256, at most the context.
    assert window_cache_cells(8192, 32, 4, 16, unified=True) == 256
    assert window_cache_cells(32768, 512, 20, 512, unified=True) == 10752
    assert window_cache_cells(32768, 512, 20, 512, unified=False) == 1024
    assert window_cache_cells(2048, 512, 20, 512, unified=True) == 2048


@pytest.mark.parametrize(
    ("cells_from", "pos", "kept"),
    [
        (0, 500, True),  # nothing ever recycled
        (0, 5, True),
        (689, 1200, True),  # a continuation: the window before 1200 is [689, 1200)
        (690, 1200, False),  # ... one position more and it is not
        (1, 300, False),  # inside the first window every position is needed
        (689, 600, False),  # a cut below what is left
    ],
)
def test_window_kept(cells_from: int, pos: int, kept: bool) -> None:
    assert window_kept(cells_from, pos, 512) is kept
    assert window_kept(cells_from, pos, 0) is True  # no window: nothing is ever recycled


def test_window_joins() -> None:
    # A receiver holding [0, 600) with its window takes [600, 900) from a sequence that
    # still holds 600 and on: one unbroken run. From one that lost 600: a gap.
    assert window_joins(600, 600, 900, 512)
    assert not window_joins(601, 600, 900, 512)
    # An empty receiver ([0, 0)) needs only the window before the reuse point.
    assert window_joins(389, 0, 900, 512)
    assert not window_joins(390, 0, 900, 512)
    assert window_joins(0, 0, 900, 512) and window_joins(123, 0, 900, 0)


@pytest.mark.parametrize(
    ("p0", "p1", "n_swa", "spans"),
    [
        (0, 5, 0, [(0, 5)]),  # no window: one span
        (7, 7, 0, []),
        (70, 200, 32, [(70, 96), (96, 128), (128, 160), (160, 192), (192, 200)]),
        (0, 64, 32, [(0, 32), (32, 64)]),
        (31, 33, 32, [(31, 32), (32, 33)]),
    ],
)
def test_save_spans_cover_the_range_a_window_at_most_each(
    p0: int, p1: int, n_swa: int, spans: list[tuple[int, int]]
) -> None:
    got = save_spans(p0, p1, n_swa)
    assert got == spans
    # Each span is at most a window long and inside one window-aligned chunk: llama.cpp's
    # writer keeps every cell of it (standard and chunked attention alike).
    for a, b in got:
        assert a < b and (n_swa == 0 or (b - a <= n_swa and a // n_swa == (b - 1) // n_swa))
