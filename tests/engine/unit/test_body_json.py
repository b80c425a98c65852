"""Body decoding: nesting measured without recursion, numbers and text JSON cannot carry."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from polykv_api.limits import MAX_JSON_DEPTH
from polykv_engine.http.errors import ApiError, decode_json, json_depth


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"{}", 1),
        (b'{"a": [1, [2, {"b": []}]]}', 5),
        (b'{"s": "[[[[{{{{ \\" [[[["}', 1),  # brackets inside strings are text
        (b'{"a": "\\\\", "b": [[]]}', 3),  # an escaped backslash ends before the quote
        (b"[" * 200_000 + b"]" * 200_000, 200_000),
    ],
)
def test_depth_is_measured_outside_strings(raw: bytes, depth: int) -> None:
    assert json_depth(raw) == depth


def refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode_json(raw)
    return info.value


def test_nesting_past_the_limit_is_refused_before_parsing() -> None:
    deep = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    err = refused(deep)
    assert (err.status, err.reason) == (400, "json_too_deep")
    assert f"the limit is {MAX_JSON_DEPTH}" in err.message
    ok = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert decode_json(ok)["a"]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"n": NaN}', "NaN is not a JSON number"),
        (b'{"n": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"n": 1e400}', "1e400 is out of the range"),
        (b'{"n": ' + b"9" * 5000 + b"}", "digits"),
        (b'{"s": "\\ud800"}', "surrogates not allowed"),
        (b'{"s": "\xff"}', "not valid JSON"),
        (b"[1]", "must be a JSON object"),
        (b"", "empty"),
    ],
)
def test_what_json_cannot_carry_is_a_400(raw: bytes, needle: str) -> None:
    err = refused(raw)
    assert err.status == 400 and err.reason == "invalid_json"
    assert needle in err.message


def test_paired_surrogates_and_nul_are_text() -> None:
    body = decode_json(b'{"s": "\\ud83d\\ude00 \\u0000"}')
    assert body["s"] == "\U0001f600 \x00"


def test_the_offload_threads_have_a_large_stack() -> None:
    """A C recursion 200k deep overflows a default 8 MiB thread stack (the process dies)
    and completes on an offload thread."""
    script = textwrap.dedent(
        """
        import json, sys, threading
        from polykv_engine.http.offload import LargeStackExecutor
        sys.setrecursionlimit(10**7)
        value = []
        for _ in range(200_000):
            value = [value]
        if sys.argv[1] == "offload":
            print(len(LargeStackExecutor(1).submit(json.dumps, value).result()))
        else:
            t = threading.Thread(target=lambda: print(len(json.dumps(value))))
            t.start()
            t.join()
        """
    )
    run = [sys.executable, "-c", script]
    done = subprocess.run([*run, "offload"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == str(400_002), done.stderr[-2000:]
    plain = subprocess.run([*run, "plain"], capture_output=True, text=True, timeout=120)
    assert plain.returncode != 0  # the bound the large stack lifts is real
