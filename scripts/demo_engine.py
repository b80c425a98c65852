"""The engine demo: polykv-engine on the generated test model, a pool tree, an agent attach."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from polykv_engine.testing import running_engine

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are the research crew. Share what you find, cite sources, keep answers short."


def main() -> int:
    model = ROOT / "models" / "polykv-test.gguf"
    log = ROOT / ".run" / "demo-engine.log"
    log.parent.mkdir(exist_ok=True)
    with running_engine(model, ["-np", "4", "-c", "8192", "--metrics"], log) as eng:
        print(f">> engine up at {eng.base_url} (log: {log})")
        c = httpx.Client(base_url=eng.base_url, timeout=60)
        system = {"role": "system", "content": SYSTEM}
        briefing = {"role": "user", "content": "Briefing: plan the survey."}
        print(">> root pool 'crew' from a system prompt")
        c.post("/polykv/pools", json={"name": "crew", "messages": [system]}).raise_for_status()
        print(">> 'planner' extends it with a briefing; 'toolset-b' branches off inside it")
        c.post("/polykv/pools/crew/fork", json={"name": "planner", "messages": [system, briefing]})
        other = {"role": "system", "content": "You are the research crew with shell tools."}
        c.post("/polykv/pools/crew/fork", json={"name": "toolset-b", "messages": [other]})
        print(">> agent-1 attaches to 'planner' through the OpenAI chat API")
        r = c.post(
            "/v1/chat/completions",
            headers={"x-session-id": "agent-1"},
            json={
                "pool_id": "planner",
                "max_tokens": 16,
                "temperature": 0,
                "messages": [system, briefing, {"role": "user", "content": "Go."}],
            },
        ).json()
        t = r["timings"]
        print(f"   answer: {r['choices'][0]['message']['content']!r}")
        print(f"   prompt tokens from the pool: {t['cache_n']}, computed: {t['prompt_n']}")
        print(">> GET /polykv/pools")
        lst = c.get("/polykv/pools").json()
        print(f"   {'PATH':<20} {'LEN':>5} {'D':>5} {'OWN KV':>9} {'SESSIONS':>8}")
        for p in lst["pools"]:
            print(
                f"   {p['path']:<20} {p['prefix_len']:>5} {p['branch_pos']:>5} "
                f"{p['own_kv_bytes']:>9} {len(p['sessions']):>8}"
            )
        print(f"   KV cells in use: {lst['kv_cells_used']} of {lst['kv_cells_total']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
