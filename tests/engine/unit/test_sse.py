"""Server-sent events survive clients that split lines at every Unicode line break."""

from __future__ import annotations

import json

import httpx

from polykv_engine.http.sse import Named, frame


def test_unicode_line_breaks_are_escaped_and_decode_the_same() -> None:
    content = "next\x85line\u2028para\u2029é \\ \u2028"
    event = frame({"content": content})
    assert event.endswith(b"\n\n") and event.count(b"\n") == 2
    # A client splitting like httpx's iter_lines (U+0085, U+2028, ... count as breaks) still
    # gets the whole event on one line, and JSON gives the same text back.
    lines = list(httpx.Response(200, content=event).iter_lines())
    assert len([line for line in lines if line]) == 1
    assert json.loads(lines[0].removeprefix("data: ")) == {"content": content}
    # Plain ASCII and other non-ASCII text are written as they were.
    assert frame({"content": "plain"}) == b'data: {"content": "plain"}\n\n'
    assert frame({"content": "é"}) == 'data: {"content": "é"}\n\n'.encode()
    assert frame("[DONE]") == b"data: [DONE]\n\n"
    # A named event (Anthropic's and OpenAI Responses' streams) leads with its name.
    named = frame(Named("ping", {"type": "ping"}))
    assert named == b'event: ping\ndata: {"type": "ping"}\n\n'
