#!/usr/bin/env bash
# Create .venv with every pinned dependency. Idempotent: a second run takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || { echo "!! $PY not found: PolyKV needs CPython 3.11" >&2; exit 1; }
WHEEL="$(PYTHON="$PY" scripts/build-llama-wheel.sh | tail -1)"
STAMP=".venv/.polykv-setup"
WANT="$(cat pyproject.toml "$WHEEL" scripts/setup.sh | sha1sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
echo ">> installing PolyKV and its pinned dependencies into .venv" >&2
# The cached wheel itself, replacing any other build of the same version (pip would keep it).
.venv/bin/python -m pip install -q --force-reinstall --no-deps "$WHEEL" >&2
# --find-links picks up the cached llama-cpp-python wheel instead of compiling again.
.venv/bin/python -m pip install -q --find-links "$(dirname "$WHEEL")" -e ".[engine,modelgen,operator,router,langgraph,dev]" >&2
echo "$WANT" > "$STAMP"
echo ">> .venv ready" >&2
