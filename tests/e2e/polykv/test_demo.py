"""The README's first command, `make demo` (scripts/demo_operator.py), run whole on a
control plane of its own: the answer a newcomer sees must be a real one, and the tree must
show. (A 135M model that answered with a tool call once broke it without any test noticing.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


def test_the_demo_shows_a_real_answer_and_the_pool_tree(tmp_path: Path) -> None:
    # The limit is a backstop far above the ~20 s it takes warm: the demo waits on
    # conditions itself and fails with its own message.
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo_operator.py"), "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    answer = next(ln for ln in text.splitlines() if ln.strip().startswith("answer ("))
    assert len(answer.split(":", 1)[1].split()) >= 3, answer  # words, not an empty reply
    assert "prompt tokens from the pool" in text
    for path in ("crew/planner", "crew/shell-crew"):
        assert path in text, text[-4000:]
    assert "stopped" in text  # it tore down what it started
