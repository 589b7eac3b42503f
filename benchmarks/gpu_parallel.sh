#!/usr/bin/env bash
# Several GPUs of one machine at once: one group of gpu_session.sh suites per GPU, in parallel.
#
#   bash benchmarks/gpu_parallel.sh "tests kernels" "speed"     # GPU 0 and GPU 1
#
# Installs once, then each group runs with CUDA_VISIBLE_DEVICES set to its GPU; each group's
# output goes to $OUT/gpuN.txt (step logs to $OUT/<stage>.log as usual) and is printed at the end.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gemma4opt-out}
mkdir -p "$OUT"
bash "$(dirname "$0")/gpu_session.sh"            # installs, runs no stage
i=0
for group in "$@"; do
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$i GEMMA4OPT_SKIP_INSTALL=1 bash "$(dirname "$0")/gpu_session.sh" $group > "$OUT/gpu$i.txt" 2>&1 &
  i=$((i + 1))
done
wait
for ((j = 0; j < i; j++)); do echo "#### GPU $j"; grep -E "^== " "$OUT/gpu$j.txt"; done
for ((j = 0; j < i; j++)); do echo "#### GPU $j tail"; tail -25 "$OUT/gpu$j.txt"; done
