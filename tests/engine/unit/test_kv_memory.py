"""kv.memory: the kind of memory a model keeps, and the arithmetic of its rules (pure)."""

from __future__ import annotations

import pytest

from polykv_engine.kv.memory import (
    Memory,
    recycle_horizon,
    recycled_below,
    save_spans,
    window_cache_cells,
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
    ("horizon", "keep", "protected", "lost"),
    [
        (0, 500, 0, False),  # nothing ever left the window
        (689, 1200, 0, False),  # a continuation: the window before the end is the newest
        (689, 600, 0, True),  # a cut inside the part that left the window
        (689, 600, 300, True),  # protected prefix shorter than the lost part
        (689, 600, 700, False),  # keep inside the guarded pool's cells
        (389, 900, 200, False),  # the window [389, 900) is above everything that may be lost
        (390, 900, 200, True),  # ... one position more and it is not
    ],
)
def test_recycled_below(horizon: int, keep: int, protected: int, lost: bool) -> None:
    assert recycle_horizon(1200, 512) == 689  # the token at 1200 sees [689, 1200)
    assert recycle_horizon(100, 512) == 0 and recycle_horizon(5000, 0) == 0
    assert recycled_below(horizon, 512, keep, protected) is lost
    assert recycled_below(horizon, 0, keep, protected) is False  # no window, nothing recycled


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
