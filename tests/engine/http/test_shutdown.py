"""SIGTERM under load: readiness fails at once, new work is refused, in-flight work finishes."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import httpx

from polykv_engine.testing import EngineProcess

from .test_completion import sse_events


def test_sigterm_drains_in_flight_streams(start_engine: Callable[..., EngineProcess]) -> None:
    eng = start_engine("-np", "2", "--shutdown-timeout", "300")  # a loaded 2-core machine
    assert eng.proc is not None
    body = {"prompt": "drain me", "n_predict": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    got: dict[str, object] = {}
    started = threading.Event()

    def stream() -> None:
        n = 0
        with httpx.stream("POST", f"{eng.base_url}/completion", json=body, timeout=60) as r:
            for data in sse_events(r):
                ev = json.loads(data)
                if ev.get("stop", True):
                    got["final"] = ev
                else:
                    n += 1
                    started.set()
        got["n"] = n

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    eng.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    health = 0
    while time.monotonic() < deadline:
        health = httpx.get(f"{eng.base_url}/health").status_code
        if health == 503:
            break
        time.sleep(0.01)
    assert health == 503  # readiness fails at once
    r = httpx.post(f"{eng.base_url}/completion", json={"prompt": "late", "n_predict": 2})
    assert r.status_code == 503 and r.headers["Retry-After"].isdigit()
    t.join(300)
    final = got["final"]
    assert isinstance(final, dict) and final.get("tokens_predicted") == 1500, final  # not cut
    assert eng.proc.wait(60) == 0
