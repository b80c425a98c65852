"""--chat-template-file: the engine renders chats with it instead of the model file's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from polykv_engine.testing import EngineProcess

TURNS = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[reply] "


def test_chats_render_with_the_given_template(
    start_engine: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    path = tmp_path / "turns.jinja"
    path.write_text(TURNS)
    eng = start_engine("-np", "1", "-c", "1024", "--chat-template-file", str(path))
    with httpx.Client(base_url=eng.base_url, timeout=60.0) as c:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        r = c.post("/apply-template", json={"messages": msgs})
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == "[system] Be brief.\n[user] Hi\n[reply] "
        assert c.get("/props").json()["chat_template"] == TURNS
        body = {"messages": msgs, "max_tokens": 4, "temperature": 0}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        rendered = {"content": "[system] Be brief.\n[user] Hi\n[reply] ", "add_special": True}
        tokens = c.post("/tokenize", json=rendered).json()["tokens"]
        assert r.json()["usage"]["prompt_tokens"] == len(tokens)  # what it rendered went in
