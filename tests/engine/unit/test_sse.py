"""Server-sent events survive clients that split lines at every Unicode line break."""

from __future__ import annotations

import json

import httpx

from polykv_engine.http.routes.inference import _sse


def test_unicode_line_breaks_are_escaped_and_decode_the_same() -> None:
    content = "next\x85line\u2028para\u2029é \\ \u2028"
    event = _sse({"content": content})
    assert event.endswith(b"\n\n") and event.count(b"\n") == 2
    # A client splitting like httpx's iter_lines (U+0085, U+2028, ... count as breaks) still
    # gets the whole event on one line, and JSON gives the same text back.
    lines = list(httpx.Response(200, content=event).iter_lines())
    assert len([line for line in lines if line]) == 1
    assert json.loads(lines[0].removeprefix("data: ")) == {"content": content}
    # Plain ASCII and other non-ASCII text are written as they were.
    assert _sse({"content": "plain"}) == b'data: {"content": "plain"}\n\n'
    assert _sse({"content": "é"}) == 'data: {"content": "é"}\n\n'.encode()
    assert _sse("[DONE]") == b"data: [DONE]\n\n"
