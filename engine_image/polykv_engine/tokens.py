"""Token-sequence helpers shared by every layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def common_prefix_len(a: Sequence[T], b: Sequence[T]) -> int:
    """How many leading tokens (or characters) ``a`` and ``b`` have in common.

    Called for every slot and pool on every request (automatic prefix sharing), with
    prompts of thousands of tokens: slices compare in C, so bisect on slice equality and
    finish the last few tokens one by one.
    """
    if not isinstance(a, list):
        a = list(a)  # slices of different sequence types never compare equal
    if not isinstance(b, list):
        b = list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo
