#!/usr/bin/env bash
# Install gemma4opt and what it needs into the current python3, from scratch if need be.
# Idempotent: a machine that already has torch (e.g. the GPU machine) keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check"
# Machines of this workplace keep a CPU build of torch on disk; use it when present.
[ -d /opt/wheels ] && PIP="$PIP --find-links /opt/wheels"
if ! python3 -c "import torch" 2>/dev/null; then
    # The CPU build (a CUDA build is several GB; CPU machines and CI need none of it).
    $PIP "torch==2.13.0" || $PIP "torch>=2.11,<2.15"
fi
$PIP -c scripts/constraints.txt -e ".[test]"
