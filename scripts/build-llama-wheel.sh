#!/usr/bin/env bash
# Build (once) and cache the llama-cpp-python wheel outside the repo.
# The compile takes ~8 minutes on 2 cores; every later run reuses the cached wheel.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-python3.11}"
PYTAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
CACHE_ROOT="${POLYKV_CACHE:-$HOME/.cache/polykv}"
# The key names everything that changes the binary: version, interpreter, arch, cmake args.
ARGS_KEY="$(printf '%s' "${CMAKE_ARGS:-}" | sha1sum | cut -c1-8)"
DEST="$CACHE_ROOT/wheels/llama-cpp-python-$VERSION-$PYTAG-$(uname -m)-$ARGS_KEY"
mkdir -p "$CACHE_ROOT/wheels"
# One build at a time: a second caller waits for the first and then reuses its wheel.
exec 9>"$DEST.lock"
flock 9
if ls "$DEST"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  ls "$DEST"/llama_cpp_python-*.whl
  exit 0
fi
mkdir -p "$DEST.tmp"
echo ">> building llama-cpp-python $VERSION from source (one time, ~8 min on 2 cores); log: $DEST.log" >&2
start=$(date +%s)
# Progress: the compile prints ninja's [n/N] steps into the log; echo the latest one every 20 s.
( while sleep 20; do
    step="$(grep -aoE '\[[0-9]+/[0-9]+\]' "$DEST.log" 2>/dev/null | tail -1 || true)"
    echo ">>   still building llama-cpp-python ${step:-(configuring)} $(( $(date +%s) - start ))s" >&2
  done ) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$PY" -m pip wheel -v --no-deps "llama-cpp-python==$VERSION" -w "$DEST.tmp" >"$DEST.log" 2>&1 || {
    echo "!! llama-cpp-python build failed; tail of $DEST.log:" >&2; tail -40 "$DEST.log" >&2; exit 1; }
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo ">> built in $(( $(date +%s) - start ))s" >&2
ls "$DEST"/llama_cpp_python-*.whl
