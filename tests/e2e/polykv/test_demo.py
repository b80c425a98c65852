"""The front page's five minutes, run as written on a control plane of its own: `make demo`
(scripts/demo_operator.py, kept running), then the README's own blocks: a pool of one's own
declared with kubectl, and an agent (the OpenAI SDK) on it. The answers a newcomer sees must
be real ones, and the tree must show. (A 135M model that answered with a tool call once
broke the demo without any test noticing.)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
# A backstop far above the ~20 s the demo takes warm: it waits on conditions itself and
# fails with its own message.
LIMIT_S = 900


def front_page_block(name: str) -> str:
    """The README's fenced block marked `readme-test:<name>`, as one bash script."""
    m = re.search(
        rf"<!-- readme-test:{name} -->\n```bash\n(.*?)```\n<!-- /readme-test -->",
        (ROOT / "README.md").read_text(),
        re.S,
    )
    assert m is not None, f"README has no readme-test:{name} block"
    return m.group(1)


def exported(text: str) -> dict[str, str]:
    """The `export NAME=value` lines the kept demo prints for the reader to paste."""
    return dict(re.findall(r"^\s*export (KUBECONFIG|PATH)=(\S+)$", text, re.M))


def run_demo(state: Path) -> str:
    demo = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "demo_operator.py"), "--keep", "--dir", str(state)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, to interrupt or kill as a whole
    )
    try:
        text, _ = demo.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGINT)  # its own teardown runs on the interrupt
        text, _ = demo.communicate(timeout=120)
        pytest.fail(f"the demo ran past {LIMIT_S} s:\n{text[-4000:]}")
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 0, text[-4000:]
    return text


def run_block(name: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", front_page_block(name)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"README block {name} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def stop_by_pid(pid: int) -> None:
    """SIGTERM, then SIGKILL if it is still there after its grace (not our child: polled)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            os.kill(pid, 0)  # raises once it is gone
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)


def test_the_front_page_five_minutes(tmp_path: Path) -> None:
    try:
        text = run_demo(tmp_path)
        answer = next(ln for ln in text.splitlines() if ln.strip().startswith("answer ("))
        assert len(answer.split(":", 1)[1].split()) >= 3, answer  # words, not an empty reply
        assert "prompt tokens from the pool" in text
        for path in ("crew/planner", "crew/shell-crew"):
            assert path in text, text[-4000:]

        env = {**os.environ, **exported(text)}
        assert {"KUBECONFIG", "PATH"} <= exported(text).keys(), text[-2000:]
        env["PATH"] = env["PATH"].replace("$PATH", os.environ["PATH"])
        pools = run_block("pool", env)
        assert re.search(r"^support\s+support\s", pools, re.M), pools
        agent = run_block("agent", env)
        words = re.search(r"^answer: (.+)$", agent, re.M)
        assert words is not None and len(words.group(1).split()) >= 3, agent
        cached = re.search(r"^prompt tokens read from the pool: (\d+)$", agent, re.M)
        assert cached is not None and int(cached.group(1)) > 0, agent
    finally:
        # The kept demo's operator (its own session; the demo wrote down its pid), then
        # whatever the demo left of its control plane (by its state directory's pid files).
        pid_file = tmp_path / "operator.pid"
        if pid_file.exists():
            stop_by_pid(int(pid_file.read_text()))
        dev = Path(sys.executable).with_name("polykv-dev")
        down = subprocess.run(
            [str(dev), "--dir", str(tmp_path), "down"],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
    assert "stopped" in down.stdout, down.stdout + down.stderr
