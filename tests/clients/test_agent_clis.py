"""The real agent CLIs, unmodified, against an engine on a real model: Claude Code
(``claude -p``, Anthropic Messages) and Codex (``codex exec``, OpenAI Responses) each run a
model turn, and a second run reads the first's prefix (system prompt and tools) from KV.

The model is Gemma 3 270M base at the CLIs' default temperature: its answer is often a tool
call, or text it does not end by itself, so each run is one model turn (``claude -p
--max-turns 1``; Codex stopped at its first answer) and ``-n`` cuts a long one (Claude Code
takes the cut text; Codex reports ``max_output_tokens``, as it would from OpenAI).

Both install from the npm registry (cached under ``~/.cache/polykv/agent-clis``, keyed by
their versions; Claude Code's platform binary comes from its optional ``-linux-x64``
package, copied in place by its postinstall script, which is run here). Their prompts are
~10k tokens of system prompt and tools: past SmolLM2's 8k window, so the engine runs Gemma
3 270M (32k). Gemma 3 keeps sliding-window layers, whose cells llama.cpp recycles; with
``--swa-full`` it keeps them all, so a later prompt can reuse a cached prefix (one slot
here, which the second run reuses).

Where the time goes: each CLI's first run prefills its whole prompt once (the kept prefix
its ``cache_control`` breakpoints or ``prompt_cache_key`` ask for); the second run computes
only what follows the user's words. The CLIs' own deadlines are raised to the run's
timeout: by default Claude Code gives up on a request after 10 minutes and Codex on a
stream with no event for 5 (the engine's Responses keep-alives are SSE comments), and each
then sends the request again, which the engine may compute again from the start.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_engine.testing import EngineProcess

# Each run prefills ~12k tokens cold, then decodes under a grammar over a 262k vocabulary.
pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.timeout(3000)]

CLAUDE = "@anthropic-ai/claude-code@2.1.328"
CODEX = "@openai/codex@0.169.0"
KEY = "cli-test-key"
CACHE = Path.home() / ".cache" / "polykv" / "agent-clis"
RUN_TIMEOUT_S = 1800  # a cold 12k-token prefill on two loaded cores
CLI_TIMEOUT_MS = str(RUN_TIMEOUT_S * 1000)  # the CLIs wait as long as the test does


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``node_modules/.bin`` with both CLIs, installed once per pair of versions."""
    home = CACHE / hashlib.sha256(f"{CLAUDE} {CODEX}".encode()).hexdigest()[:16]
    done = home / "installed"
    if not done.is_file():
        work = tmp_path_factory.mktemp("npm")
        npm = ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(work), CLAUDE, CODEX]
        subprocess.run(npm, check=True, timeout=900)
        script = work / "node_modules" / "@anthropic-ai" / "claude-code" / "install.cjs"
        subprocess.run(["node", str(script)], cwd=script.parent, check=True, timeout=300)
        shutil.rmtree(home, ignore_errors=True)
        home.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(work), str(home))
        done.write_text(f"{CLAUDE} {CODEX}\n")
    return home / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def engine(gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    logs = tmp_path_factory.mktemp("cli-engine")
    # -n: Claude Code asks for 128000 tokens, and a 270M model may never stop by itself.
    args = ("-np", "1", "-c", "32768", "--swa-full", "-n", "48", "--api-key", KEY)
    eng = EngineProcess(gemma3, args, log_path=logs / "engine.log")
    eng.start(timeout=300)
    yield eng
    eng.stop()


def _env(extra: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    return {**base, **extra}


def _claude(bin_dir: Path, eng: EngineProcess, home: Path, prompt: str) -> dict[str, Any]:
    """One ``claude -p`` run of one model turn (``--max-turns 1``: a small model may well
    answer with a tool call, which would start another turn)."""
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": eng.base_url,
        "ANTHROPIC_API_KEY": KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        # Its defaults (10 minutes) are shorter than a cold prefill on two loaded cores.
        "API_TIMEOUT_MS": CLI_TIMEOUT_MS,
        "CLAUDE_STREAM_FIRST_BYTE_TIMEOUT_MS": CLI_TIMEOUT_MS,
    }
    # No Agent tool: a sampled call to it starts a sub-agent, whose own turns --max-turns does
    # not bound (seen: 14 turns, 15 minutes, the parent's kept prefix expired meanwhile).
    cmd = [str(bin_dir / "claude"), "-p", prompt, "--output-format", "json", "--max-turns", "1",
           "--disallowedTools", "Agent"]  # fmt: skip
    done = subprocess.run(
        cmd, env=_env(env), cwd=home, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    out: dict[str, Any] = json.loads(done.stdout)
    # Done: answered (rc 0), or a tool call it may not follow with another turn (rc 1).
    assert out["type"] == "result" and out.get("api_error_status") is None, out
    assert out["subtype"] in ("success", "error_max_turns") and out["num_turns"] >= 1, out
    return out


def test_claude_code_completes_a_turn_and_the_next_run_reuses_its_prefix(
    bin_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    first = _claude(bin_dir, engine, tmp_path, "Say hi")
    usage = first["usage"]
    assert usage["input_tokens"] + usage["cache_creation_input_tokens"] > 8192  # past SmolLM2
    second = _claude(bin_dir, engine, tmp_path, "Say hello")
    # The system prompt and tools (everything before the user's words) come from KV.
    assert second["usage"]["cache_read_input_tokens"] > 8192, (first, second)


def _slot_cache(eng: EngineProcess) -> int:
    """Prompt tokens the engine's one slot reused from KV for its latest request."""
    slots = httpx.get(f"{eng.base_url}/slots", headers={"Authorization": f"Bearer {KEY}"})
    return int(slots.json()[0]["n_prompt_tokens_cache"])


def _codex(bin_dir: Path, eng: EngineProcess, home: Path, prompt: str) -> dict[str, Any]:
    """``codex exec`` until the model's first answer is an item Codex acted on (a message,
    or a command it ran): then it is stopped, since a small model may call tools forever."""
    (home / "config.toml").write_text(
        'model = "gemma"\n'
        'model_provider = "polykv"\n'
        'web_search = "disabled"\n'  # a built-in tool: it runs on OpenAI's servers only
        "[model_providers.polykv]\n"
        'name = "polykv"\n'
        f'base_url = "{eng.base_url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "POLYKV_KEY"\n'
        f"stream_idle_timeout_ms = {CLI_TIMEOUT_MS}\n"  # 5 minutes by default
    )
    env = _env({"CODEX_HOME": str(home), "POLYKV_KEY": KEY, "HOME": str(home)})
    cmd = [str(bin_dir / "codex"), "exec", "--skip-git-repo-check", "--json", prompt]
    proc = subprocess.Popen(cmd, env=env, cwd=home, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            event = json.loads(line) if line.startswith("{") else {}
            item = event.get("item", {})
            if event.get("type") in ("turn.completed", "turn.failed", "error"):
                return dict(event)
            if event.get("type") == "item.completed" and item.get("type") != "error":
                return dict(event)  # the model's answer, parsed and acted upon
        raise AssertionError(f"codex exited {proc.wait()} before the model answered")
    finally:
        proc.terminate()
        proc.wait(30)


def _answered(event: dict[str, Any]) -> bool:
    """Codex took the model's answer: an item it acted on, a finished turn, or the answer
    cut at ``-n`` (``response.incomplete``: Codex parsed the whole stream and reports the
    cut, as it does for OpenAI's own ``max_output_tokens``)."""
    cut = "Incomplete response returned, reason: max_output_tokens"
    return event["type"] in ("item.completed", "turn.completed") or cut in str(event)


def test_codex_runs_a_turn_and_the_next_run_reuses_its_prefix(
    bin_dir: Path, engine: EngineProcess, tmp_path: Path
) -> None:
    first = _codex(bin_dir, engine, tmp_path, "Say hi")
    assert _answered(first), first
    second = _codex(bin_dir, engine, tmp_path, "Say hello")
    assert _answered(second), second
    # Its instructions and tools (everything before the user's words) came from KV.
    assert _slot_cache(engine) > 8192
