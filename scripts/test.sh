#!/usr/bin/env bash
# The test command: set up from scratch if needed, then run the whole CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest -q -p no:cacheprovider tests "$@"
