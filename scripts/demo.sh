#!/usr/bin/env bash
# `make demo`: the main job on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/demo_engine.py
