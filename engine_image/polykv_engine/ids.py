"""Ids and numbers that arrive as text (URL paths, query strings, names)."""

from __future__ import annotations


def decimal(text: str) -> int | None:
    """``text`` as a non-negative integer if it is ASCII digits only, else None. (str.isdigit
    also accepts "²" and other Unicode digits that int() refuses.)"""
    if text and text.isascii() and text.isdigit():
        return int(text)
    return None
