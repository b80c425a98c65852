#!/usr/bin/env bash
# Generate the deterministic test and bench models (seconds). A model is rebuilt when the
# generator's source changes, so tests never run against a stale file.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models
GEN_HASH="$(cat engine_image/polykv_modelgen/*.py | sha1sum | cut -c1-12)"
for preset in test bench test-swa test-mamba test-jamba; do
  out="models/polykv-$preset.gguf"
  if [[ ! -s "$out" || "$(cat "$out.stamp" 2>/dev/null)" != "$GEN_HASH" ]]; then
    .venv/bin/polykv-make-model --preset "$preset" "$out"
    echo "$GEN_HASH" > "$out.stamp"
  fi
done
