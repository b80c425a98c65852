#!/usr/bin/env bash
# Create (once) the virtualenv of the benchmark baseline: llama-cpp-python's own OpenAI server,
# i.e. `llama_cpp_python[server]`, with every package pinned.
#
# It lives OUTSIDE the repo (default ~/.cache/polykv/bench-venv, override POLYKV_BENCH_VENV)
# so the project's .venv never sees fastapi/uvicorn. llama-cpp-python itself comes from the
# wheel scripts/build-llama-wheel.sh caches: the baseline runs the very same libllama as the
# engine. Idempotent: a second run checks a stamp and returns at once.
#
# Prints the venv's python as the last line of stdout; progress goes to stderr.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3.11}"
VENV="${POLYKV_BENCH_VENV:-$HOME/.cache/polykv/bench-venv}"

# The resolver's choice for llama_cpp_python[server]==0.3.36 on CPython 3.11, frozen.
PINS=(
  "llama_cpp_python[server]==0.3.36"
  annotated-doc==0.0.7
  annotated-types==0.8.0
  anyio==4.16.0
  click==8.5.1
  diskcache==5.6.3
  fastapi==0.165.0
  h11==0.16.0
  idna==3.20
  Jinja2==3.1.6
  MarkupSafe==3.0.4
  numpy==2.4.6
  opentelemetry-api==1.45.2
  pydantic==2.14.4
  pydantic-settings==2.16.3
  pydantic_core==2.50.5
  python-dotenv==1.2.4
  PyYAML==6.0.4
  sse-starlette==3.7.0
  starlette==1.10.0
  starlette-context==0.3.6
  typing-inspection==0.4.5
  typing_extensions==4.16.0
  uvicorn==0.54.0
)

WHEEL="$(PYTHON="$PY" "$ROOT/scripts/build-llama-wheel.sh" | tail -1)"
STAMP="$VENV/.polykv-bench-setup"
WANT="$( (printf '%s\n' "${PINS[@]}"; echo "$WHEEL") | sha1sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
echo ">> creating the baseline venv $VENV (llama-cpp-python's [server] extra)" >&2
mkdir -p "$(dirname "$VENV")"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# --find-links: the cached wheel, never a second 8-minute compile.
"$VENV/bin/python" -m pip install -q --find-links "$(dirname "$WHEEL")" "${PINS[@]}" >&2
"$VENV/bin/python" -c 'import llama_cpp.server.app' >&2
echo "$WANT" >"$STAMP"
echo ">> baseline venv ready" >&2
echo "$VENV/bin/python"
