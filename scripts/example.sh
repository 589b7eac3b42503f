#!/usr/bin/env bash
# The main job: set up from scratch if needed, then run examples/generate.py (args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 examples/generate.py "$@"
