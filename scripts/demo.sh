#!/usr/bin/env bash
# `make demo`: the main job on the embedded default: a local control plane, the operator, an
# engine on a real instruction model (SmolLM2-135M-Instruct), a pool tree and an admission policy from examples/, and
# `kubectl get polykvpools`. Pass --keep (DEMO_ARGS=--keep make demo) to leave it running.
# The engine-only demo is still there: .venv/bin/python scripts/demo_engine.py
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/demo_operator.py ${DEMO_ARGS:-} "$@"
