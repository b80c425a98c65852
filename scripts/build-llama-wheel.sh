#!/usr/bin/env bash
# Build (once) and cache a portable llama-cpp-python wheel outside the repo.
#
# Portable: no -march=native. ggml's CPU backend is built once per x86 feature level
# (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS, as llama.cpp's release images do) and the best
# one for the CPU at hand is picked when the engine starts, so a wheel or image built on one
# CPU runs on any other x86-64 CPU.
#
# AMX off: the "sapphirerapids" variant is the only one compiled with AMX_TILE/AMX_INT8, and
# ggml's AMX matmul path (taken for quantized weights) dies with SIGILL on AMX Xeons when the
# thread lacks the AMX permission (llama.cpp PR 26954, not in this version). We drop that
# variant from the vendored CMake list before building; an AMX Xeon then loads the next best
# variant (zen4/cooperlake, AVX-512 without AMX). The engine's tests assert that no loaded
# backend reports AMX.
#
# Patches (scripts/patches/*.patch, ours, applied to the vendored tree in name order) change
# only speed, never results: ggml-cpu-fa-live-cells.patch lets the CPU flash-attention kernel
# pass over other sequences' cells of a unified KV cache a word at a time (one cell in n is a
# query's own when n sessions decode together) and prefetch the K and V rows of the cells it
# will visit next (a query's own rows are n rows apart: too far for the hardware prefetchers
# to follow across pages). ggml-cpu-q4_1-cols.patch gives Q4_1 weights (the type of the
# SmolLM2 file on PyPI) a batched kernel: ggml has none for Q4_1 (repacking and its tiled path
# cover other types), so a decode step of n sessions unpacked every weight block n times; the
# patch unpacks it once for up to 8 tokens, and for one token reads its activations once for 4
# weight rows. ggml-cpu-q4_K_M-cols.patch does the same for Q4_K_M's two K-quants: repacked Q4_K
# weights for the 2-3 tokens ggml's 4-token tiles leave over, and Q6_K (no batched kernel on
# x86) for up to 8 tokens. ggml-cpu-q5_1-cols.patch does it for Q5_1 (no batched kernel on x86
# either): a weight block's 5-bit quants are rebuilt once for up to 8 tokens. Either way the
# logits stay bit-identical. ggml-cpu-tiled-fa-runs.patch
# sends a paced prompt chunk's attention (under 64 rows) to ggml's tiled kernel, whose tiles
# pack only the cells their rows see: exact to float32 rounding (tests/engine/real), though
# its sums round otherwise than the per-query kernel's. ggml-cpu-zmm-q0-cols.patch gives Q8_0 and
# Q5_0 weights (most of a small model's Q4_K_M bytes, and all of a Q8_0 model's) a 2..64-token
# kernel in the zen4 variant that holds two weight rows per 512-bit register: the same eight
# float lanes per output, summed in the same order, as llamafile's tinyBLAS, which it replaces
# there. ggml-cpu-paths.patch
# gates these kernel paths: each is compiled into the zen4 and haswell variants only (the ones
# they were measured on) and runs only on the CPU families it was measured to win on in the
# variant loaded, chosen once from cpuid or from POLYKV_GGML_PATHS (docs/performance.md). The wheel records what it
# was built with in llama_cpp/polykv_build.json, which the engine reports in /props, with the
# paths that run.
#
# The compile takes ~15-25 minutes on 2 cores; every later run reuses the cached wheel.
# Prints the wheel path as the last line of stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="0.3.36"
SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PY="${PYTHON:-python3.11}"
PYTAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
CACHE_ROOT="${POLYKV_CACHE:-$HOME/.cache/polykv}"
# Every option that changes the binary. LLAMA_CPP_EXTRA_CMAKE_ARGS adds to them (e.g. a GPU backend).
# CMAKE_INSTALL_BINDIR puts the per-CPU backend modules next to libllama in the wheel, where
# the engine loads them from (ggml installs them into bin/ by default).
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_OPENMP=ON -DCMAKE_INSTALL_BINDIR=llama_cpp/lib ${LLAMA_CPP_EXTRA_CMAKE_ARGS:-}"
DROP_VARIANTS="sapphirerapids"
PATCHES=("$ROOT"/scripts/patches/*.patch)
# The key names everything that changes the binary: version, interpreter, arch, flags, dropped
# variants, patches, and this script itself.
KEY="$(printf '%s|%s|%s|%s' "$CMAKE_FLAGS" "$DROP_VARIANTS" "$(cat "${PATCHES[@]}" | sha1sum)" "$(sha1sum < "${BASH_SOURCE[0]}")" | sha1sum | cut -c1-10)"
DEST="$CACHE_ROOT/wheels/llama-cpp-python-$VERSION-$PYTAG-$(uname -m)-portable-noamx-$KEY"
mkdir -p "$CACHE_ROOT/wheels" "$CACHE_ROOT/sdists"
# One build at a time: a second caller waits for the first and then reuses its wheel.
exec 9>"$DEST.lock"
flock 9
if ls "$DEST"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  ls "$DEST"/llama_cpp_python-*.whl
  exit 0
fi

SDIST="$CACHE_ROOT/sdists/llama_cpp_python-$VERSION.tar.gz"
if ! echo "$SDIST_SHA256  $SDIST" | sha256sum -c --quiet 2>/dev/null; then
  echo ">> downloading the llama-cpp-python $VERSION source distribution" >&2
  rm -f "$SDIST"
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" \
    -d "$CACHE_ROOT/sdists" >&2
  echo "$SDIST_SHA256  $SDIST" | sha256sum -c --quiet || {
    echo "!! checksum mismatch for $SDIST" >&2; exit 1; }
fi

WORK="$DEST.src"
rm -rf "$WORK" "$DEST.tmp"
mkdir -p "$WORK" "$DEST.tmp"
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION"
VARIANTS_CMAKE="$SRC/vendor/llama.cpp/ggml/src/CMakeLists.txt"
for v in $DROP_VARIANTS; do
  grep -q "ggml_add_cpu_backend_variant($v " "$VARIANTS_CMAKE" || {
    echo "!! variant $v not found in $VARIANTS_CMAKE: the drop list needs review" >&2; exit 1; }
  sed -i "/ggml_add_cpu_backend_variant($v /d" "$VARIANTS_CMAKE"
done
for patch_file in "${PATCHES[@]}"; do
  patch -p1 --forward --quiet -d "$SRC" < "$patch_file" || {
    echo "!! $patch_file does not apply to llama-cpp-python $VERSION: it needs review" >&2; exit 1; }
done
"$PY" - "$SRC/llama_cpp/polykv_build.json" "$VERSION" "$CMAKE_FLAGS" "$DROP_VARIANTS" "${PATCHES[@]}" <<'EOF_PY'
import json, pathlib, sys
out, version, flags, dropped, *patches = sys.argv[1:]
manifest = {
    "version": version,
    "patches": [pathlib.Path(p).stem for p in patches],
    "dropped_variants": dropped.split(),
    "cmake_flags": flags.split(),
}
pathlib.Path(out).write_text(json.dumps(manifest, indent=1) + "\n")
EOF_PY

echo ">> building portable llama-cpp-python $VERSION (one time, ~15-25 min on 2 cores); log: $DEST.log" >&2
start=$(date +%s)
# Progress: the compile prints ninja's [n/N] steps into the log; echo the latest one every 30 s.
( while sleep 30; do
    step="$(grep -aoE '\[[0-9]+/[0-9]+\]' "$DEST.log" 2>/dev/null | tail -1 || true)"
    echo ">>   still building llama-cpp-python ${step:-(configuring)} $(( $(date +%s) - start ))s" >&2
  done ) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
CMAKE_ARGS="$CMAKE_FLAGS" \
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$PY" -m pip wheel -v --no-deps "$SRC" -w "$DEST.tmp" >"$DEST.log" 2>&1 || {
    echo "!! llama-cpp-python build failed; tail of $DEST.log:" >&2; tail -40 "$DEST.log" >&2; exit 1; }
# The wheel must carry one CPU backend per feature level and none with AMX.
listing="$("$PY" -m zipfile -l "$DEST.tmp"/llama_cpp_python-*.whl)"
grep -q 'llama_cpp/lib/libggml-cpu-haswell.so' <<<"$listing" || {
  echo "!! the wheel has no per-CPU backends; GGML_CPU_ALL_VARIANTS did not take" >&2; exit 1; }
grep -q 'llama_cpp/polykv_build.json' <<<"$listing" || {
  echo "!! the wheel lost llama_cpp/polykv_build.json" >&2; exit 1; }
if grep -q 'libggml-cpu-sapphirerapids' <<<"$listing"; then
  echo "!! the wheel still carries the AMX backend" >&2; exit 1
fi
rm -rf "$DEST" "$WORK" && mv "$DEST.tmp" "$DEST"
echo ">> built in $(( $(date +%s) - start ))s" >&2
ls "$DEST"/llama_cpp_python-*.whl
