#!/usr/bin/env bash
# Build (once) llama-server from the very llama.cpp tree the engine runs on: the source
# vendored in the pinned llama-cpp-python sdist, with the same portable CPU build (per-CPU
# backends, AMX variant dropped).
#
#   bench/build_llama_server.sh              upstream llama-server: ggml's own kernels, none
#                                            of ours. The engine's wheel does NOT run the same
#                                            kernels: scripts/build-llama-wheel.sh applies
#                                            scripts/patches/*.patch to ggml.
#   bench/build_llama_server.sh --patched    the same source with scripts/patches/*.patch
#                                            applied as the wheel applies them: the engine's
#                                            kernels behind llama-server's own scheduler, so a
#                                            benchmark can tell the server from the kernels.
#
# Cached outside the repo (~/.cache/polykv/llama-server-<version>[-patched]-<key>), keyed by
# the sdist, the flags, the patches (--patched) and this script's commands (comments do not
# count). Prints the llama-server binary as the last line of stdout; progress goes to stderr.
# ~10 minutes cold on 2 cores; seconds when cached.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="0.3.36"
SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PY="${PYTHON:-python3.11}"
CACHE_ROOT="${POLYKV_CACHE:-$HOME/.cache/polykv}"
FLAGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_OPENMP=ON \
-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release"
DROP_VARIANTS="sapphirerapids"
PATCHES=()
FLAVOUR=""
case "${1:-}" in
  "") ;;
  --patched) PATCHES=("$ROOT"/scripts/patches/*.patch); FLAVOUR="-patched" ;;
  *) echo "usage: $0 [--patched]" >&2; exit 2 ;;
esac
PATCH_SUM="$( ((${#PATCHES[@]})) && cat "${PATCHES[@]}" | sha1sum || echo none)"
SCRIPT_SUM="$(grep -v '^[[:space:]]*#' "${BASH_SOURCE[0]}" | sha1sum)"
KEY="$(printf '%s|%s|%s|%s' "$FLAGS" "$DROP_VARIANTS" "$PATCH_SUM" "$SCRIPT_SUM" | sha1sum | cut -c1-10)"
DEST="$CACHE_ROOT/llama-server-$VERSION$FLAVOUR-$KEY"
mkdir -p "$CACHE_ROOT/sdists"
exec 9>"$DEST.lock"
flock 9
if [[ -x "$DEST/bin/llama-server" ]]; then
  echo "$DEST/bin/llama-server"
  exit 0
fi
SDIST="$CACHE_ROOT/sdists/llama_cpp_python-$VERSION.tar.gz"
if ! echo "$SDIST_SHA256  $SDIST" | sha256sum -c --quiet 2>/dev/null; then
  echo ">> downloading the llama-cpp-python $VERSION source distribution" >&2
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" \
    -d "$CACHE_ROOT/sdists" >&2
  echo "$SDIST_SHA256  $SDIST" | sha256sum -c --quiet
fi
WORK="$DEST.src"
rm -rf "$WORK" "$DEST.tmp"
mkdir -p "$WORK"
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
for v in $DROP_VARIANTS; do
  grep -q "ggml_add_cpu_backend_variant($v " "$SRC/ggml/src/CMakeLists.txt"
  sed -i "/ggml_add_cpu_backend_variant($v /d" "$SRC/ggml/src/CMakeLists.txt"
done
# The wheel's patches are made against the sdist root (paths start vendor/llama.cpp/).
for patch_file in "${PATCHES[@]}"; do
  patch -p1 --forward --quiet -d "$WORK/llama_cpp_python-$VERSION" < "$patch_file" || {
    echo "!! $patch_file does not apply to llama-cpp-python $VERSION: it needs review" >&2; exit 1; }
done
echo ">> building llama-server$FLAVOUR from the vendored llama.cpp (one time, ~10 min); log: $DEST.log" >&2
start=$(date +%s)
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$WORK/build" -G Ninja $FLAGS -DCMAKE_INSTALL_PREFIX="$DEST.tmp" \
  >"$DEST.log" 2>&1
( while sleep 30; do
    step="$(grep -aoE '\[[0-9]+/[0-9]+\]' "$DEST.log" 2>/dev/null | tail -1 || true)"
    echo ">>   still building llama-server$FLAVOUR ${step:-(configuring)} $(( $(date +%s) - start ))s" >&2
  done ) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >>"$DEST.log" 2>&1 || {
  echo "!! llama-server build failed; tail of $DEST.log:" >&2; tail -30 "$DEST.log" >&2; exit 1; }
mkdir -p "$DEST.tmp/bin"
cp "$WORK/build/bin/llama-server" "$DEST.tmp/bin/"
cp "$WORK"/build/bin/lib*.so* "$DEST.tmp/bin/" 2>/dev/null || true
find "$WORK/build" -name 'lib*.so*' -exec cp -n {} "$DEST.tmp/bin/" \;
rm -rf "$DEST" "$WORK" && mv "$DEST.tmp" "$DEST"
echo ">> built in $(( $(date +%s) - start ))s" >&2
echo "$DEST/bin/llama-server"
