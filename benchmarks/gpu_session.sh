#!/usr/bin/env bash
# One command per GPU call: install the carried FlashInfer wheels (.whl/, if present) and this
# package, then run the named stages, each under its own timeout, logging to $OUT/<stage>.log.
#
#   bash benchmarks/gpu_session.sh tests gen1          # one device call (<= 10 min)
#   bash benchmarks/gpu_session.sh paged plan kernels  # the next one
#
# Stages, most important first: tests (tiny variants on CUDA, decode graphs), gen1 (31b x 12
# layers, batch 1: gemma4opt / HF eager / HF static+compile), gen32 (same at batch 32), paged
# (FlashInfer op numerics, paged generate == eager, sync-free decode), plan (host step cost with
# FlashInfer plan), kernels (Triton vs Inductor), realdims (bf16 error vs fp32 on real dims).
# genfinal / gen2048 / gene4b / gen26b / gen31bfull: issue 5's table (paged vs HF static+compile
# vs eager); attn: FlashInfer decode wrappers vs KV bytes; profile*, profpaged*: where a step goes.
# genfinalab: issue 5's table plus gemma4opt without decode_linear (same run); linear / lintest: the
# skinny decode GEMM against cuBLAS, and its tests; linsweep: every tile of it at 32 rows; normsweep: q/k
# prep launch configs; moetest: the decode MoE experts kernels compiled and against HF at the 26b-a4b's
# dimensions (then gen26b for the end-to-end effect); ktests: tests/kernels compiled; genpdl: genfinal plus
# gemma4opt with programmatic dependent launch off.
# A fresh machine JIT-compiles FlashInfer (~2 min for the 31b's configs): keep stages that share
# configs in one call, or in calls back to back while the machine is warm.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gemma4opt-out}
mkdir -p "$OUT"
if [ -z "$GEMMA4OPT_SKIP_INSTALL" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
[ -n "$GEMMA4OPT_SKIP_INSTALL" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2

stage() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/$name.log" | tail -40
  echo "== $name rc=${PIPESTATUS[0]}"
}
PYTEST="python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short"
for s in "$@"; do
  case $s in
    # The one-liner (optimize(model), every default) first on a fresh machine, so its warm-up column
    # includes FlashInfer's JIT; then the paged mode sized for the run, HF static + compile, HF eager.
    oneliner) stage oneliner 560 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 32 \
            --systems gemma4opt gemma4opt-paged static_compile eager --json "$OUT/oneliner.jsonl" ;;
    # HF generate features on the one-liner in CUDA graphs (continuing a returned cache, assisted
    # decoding), then e2b drafting for the 31b x 12 against the 31b alone.
    features) MAX_JOBS=16 stage features 240 $PYTEST -s tests/gpu/test_gpu_features.py ;;
    assisted) stage assisted 300 python3 benchmarks/bench_assisted.py --preset 31b --layers 12 --assistant e2b \
            --json "$OUT/assisted.jsonl" ;;
    tests) stage tests 150 $PYTEST tests/gpu/test_gpu_generate.py -k "captured" ;;
    gen1) stage gen1 330 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 \
            --systems gemma4opt eager static_compile --json "$OUT/gen.jsonl" ;;
    gen32) stage gen32 330 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 32 \
            --systems gemma4opt eager static_compile --json "$OUT/gen.jsonl" ;;
    paged) MAX_JOBS=16 stage paged 480 $PYTEST -s tests/gpu/test_gpu_paged.py ;;  # JIT: ~30 s per kernel config
    plan) stage plan 120 python3 benchmarks/bench_plan.py --device cuda ;;
    kernels) stage kernels 330 python3 benchmarks/bench_kernels.py --json "$OUT/kernels.json" ;;
    realdims) stage realdims 200 $PYTEST -s tests/gpu/test_gpu_generate.py -k "real_dims" ;;
    profile) stage profile 150 python3 benchmarks/profile_decode.py --preset 31b --layers 12 --new 32 ;;
    profile32) stage profile32 150 python3 benchmarks/profile_decode.py --preset 31b --layers 12 --new 32 --batch 32 ;;
    profpaged1) stage profpaged1 240 python3 benchmarks/profile_decode.py --preset 31b --layers 12 --new 32 --attention paged ;;
    profpaged32) stage profpaged32 330 python3 benchmarks/profile_decode.py --preset 31b --layers 12 --new 32 --batch 32 --attention paged ;;
    attn) MAX_JOBS=16 stage attn 420 python3 benchmarks/bench_attention.py --json "$OUT/attention.jsonl" ;;
    genpaged) stage genpaged 420 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 32 \
            --systems gemma4opt-paged gemma4opt static_compile eager --json "$OUT/gen.jsonl" ;;
    deferpaged) MAX_JOBS=16 stage deferpaged 170 $PYTEST -s tests/gpu/test_gpu_generate.py -k "deferred and paged" ;;
    genfinal) stage genfinal 560 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 8 32 128 \
            --systems gemma4opt-paged static_compile eager --json "$OUT/gen.jsonl" ;;
    kvtest) stage kvtest 90 $PYTEST tests/kernels/test_kv_append_kernel.py ;;
    gen2048) stage gen2048 590 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 8 32 128 --prompt 2048 \
            --systems gemma4opt-paged static_compile eager --json "$OUT/gen.jsonl" ;;
    gene4b) stage gene4b 400 python3 benchmarks/bench_generate.py --preset e4b --batch 1 32 \
            --systems gemma4opt-paged static_compile eager --json "$OUT/gen.jsonl" ;;
    gene4b1) stage gene4b1 220 python3 benchmarks/bench_generate.py --preset e4b --batch 1 \
            --systems gemma4opt-paged static_compile eager --json "$OUT/gen.jsonl" ;;
    gen26b) stage gen26b 400 python3 benchmarks/bench_generate.py --preset 26b-a4b --batch 1 \
            --systems eager static_compile gemma4opt-paged --json "$OUT/gen.jsonl" ;;
    gen31bfull) stage gen31bfull 590 python3 benchmarks/bench_generate.py --preset 31b --batch 1 \
            --systems eager static_compile gemma4opt-paged --json "$OUT/gen.jsonl" ;;   # 62 GB: no copies
    plangraph) stage plangraph 200 python3 benchmarks/bench_plan.py --device cuda --graph ;;   # fast replan
    plangraphfull) stage plangraphfull 200 python3 benchmarks/bench_plan.py --device cuda --graph --full-plan ;;
    replantest) MAX_JOBS=16 stage replantest 240 $PYTEST -s tests/gpu/test_gpu_paged.py -k "replan" ;;
    planprof) stage planprof 150 python3 benchmarks/bench_plan.py --device cuda --batch 64 --steps 50 --profile ;;
    gen1paged) stage gen1paged 300 python3 benchmarks/bench_generate.py --preset 31b --layers 12 \
            --batch 1 --systems gemma4opt gemma4opt-paged eager static_compile --json "$OUT/gen.jsonl" ;;
    pagedfix) MAX_JOBS=16 stage pagedfix 420 $PYTEST -s tests/gpu/test_gpu_paged.py -k "sync or bucket or float32" ;;
    testsdefer) stage testsdefer 150 $PYTEST tests/gpu/test_gpu_generate.py -k "captured or deferred or sync" ;;
    qkvtest) stage qkvtest 120 $PYTEST tests/kernels/test_qkv_norm_rope_append_kernel.py tests/kernels/test_rms_norm_rope_kernel.py ;;
    attnsplit) MAX_JOBS=16 stage attnsplit 240 python3 benchmarks/bench_attention.py --variants fa2 --split auto c4 c8 c16 \
            --batch 1 8 --context 160 1024 4096 --json "$OUT/attention_split.jsonl" ;;
    dectest) stage dectest 200 $PYTEST -s tests/kernels/test_paged_decode_kernel.py tests/gpu/test_gpu_decode_kernel.py ;;
    gentri) stage gentri 560 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 8 32 128 \
            --systems gemma4opt-paged gemma4opt-paged-fi static_compile eager --json "$OUT/gen.jsonl" ;;
    gentri2) stage gentri2 560 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 8 32 128 \
            --systems gemma4opt-paged gemma4opt-paged-auto static_compile eager --json "$OUT/gen.jsonl" ;;
    attncfg) stage attncfg 300 bash -c 'python3 benchmarks/bench_attention.py --kinds sliding --variants triton \
            --batch 1 8 32 64 --context 160 1024 4096 --json "$OUT/attention_cfg.jsonl" && \
            python3 benchmarks/bench_attention.py --kinds full --variants triton triton-b32-w4-s2 triton-b32-w8-s3 \
            triton-b64-w8-s2 --batch 1 8 32 64 --context 160 1024 4096 --json "$OUT/attention_cfg.jsonl"' ;;
    pagedcore) MAX_JOBS=16 stage pagedcore 480 $PYTEST -s tests/gpu/test_gpu_paged.py -k "sync or bucket or window" ;;
    bucketsync) MAX_JOBS=8 stage bucketsync 480 $PYTEST -s tests/gpu/test_gpu_paged.py -k "sync or bucket" ;;  # few JIT jobs: a benchmark may share the host
    linear) stage linear 300 python3 benchmarks/bench_kernels.py --linear --presets 31b e4b --m 1 8 32 \
            --json "$OUT/linear.json" ;;   # skinny Triton GEMM (autotuned) vs cuBLAS
    windowtest) MAX_JOBS=16 stage windowtest 280 $PYTEST -s tests/gpu/test_gpu_paged.py -k "window" ;;
    bucketonly) MAX_JOBS=16 stage bucketonly 450 $PYTEST -s tests/gpu/test_gpu_paged.py -k "bucket" ;;
    # HF static + compile first, on an empty GPU, with expandable segments: after gemma4opt it ran out of
    # memory in its eager prefill (16 GiB SDPA buffer; 22.7 GiB reserved but fragmented, 40.7 GiB in
    # its cudagraph pools). gemma4opt runs last, on the model itself (no copy).
    gen2048b128) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True stage gen2048b128 540 python3 \
            benchmarks/bench_generate.py --preset 31b --layers 12 --batch 128 --prompt 2048 \
            --systems static_compile eager gemma4opt-paged --json "$OUT/gen.jsonl" ;;
    genfinalab) stage genfinalab 440 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 8 32 128 \
            --systems gemma4opt-paged static_compile eager gemma4opt-paged-cublas --json "$OUT/gen.jsonl" ;;  # + decode_linear off
    genab) stage genab 420 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 8 32 \
            --systems gemma4opt-paged gemma4opt-paged-cublas eager --json "$OUT/gen.jsonl" ;;  # decode_linear on/off
    normsweep) stage normsweep 300 python3 benchmarks/bench_kernels.py --sweep-norm-rope --presets 31b e4b \
            --m 1 32 256 8192 --json "$OUT/normsweep.jsonl" ;;   # q/k prep launch configs (head_block)
    linsweep) stage linsweep 360 python3 benchmarks/bench_kernels.py --sweep-linear --presets 31b --m 32 \
            --json "$OUT/linsweep.jsonl" ;;   # every skinny GEMM tile vs cuBLAS at 32 rows
    gen32ab) stage gen32ab 320 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 32 --repeats 5 \
            --systems gemma4opt-paged static_compile gemma4opt-paged-cublas --json "$OUT/gen.jsonl" ;;  # batch 32, best of 5
    moetest) stage moetest 150 $PYTEST tests/kernels/test_moe_experts_kernel.py tests/gpu/test_gpu_moe_experts.py ;;
    sweepgelu) stage sweepgelu 150 python3 benchmarks/bench_kernels.py --sweep gelu --m 1 32 256 8192 --json "$OUT/sweep_gelu.jsonl" ;;
    sweepsoftcap) stage sweepsoftcap 150 python3 benchmarks/bench_kernels.py --sweep softcap --m 1 32 256 --json "$OUT/sweep_softcap.jsonl" ;;
    sweepnr) stage sweepnr 150 python3 benchmarks/bench_kernels.py --sweep norm_rope --presets 31b e4b --m 32 256 --json "$OUT/sweep_nr.jsonl" ;;
    pdltest) stage pdltest 90 $PYTEST tests/kernels/test_pdl.py ;;
    genpdl132) stage genpdl132 240 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 32 \
            --systems gemma4opt-paged static_compile eager gemma4opt-paged-nopdl --json "$OUT/gen.jsonl" ;;
    sweepmoe) stage sweepmoe 150 python3 benchmarks/bench_kernels.py --sweep moe --presets 26b-a4b --m 1 4 8 --json "$OUT/sweep_moe.jsonl" ;;
    ktests) stage ktests 240 $PYTEST tests/kernels ;;     # every kernel test compiled on the GPU (PDL chain included)
    genpdl) stage genpdl 470 python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 8 32 128 \
            --systems gemma4opt-paged static_compile eager gemma4opt-paged-nopdl --json "$OUT/gen.jsonl" ;;  # + PDL off
    lintest) stage lintest 150 $PYTEST tests/kernels/test_skinny_linear_kernel.py tests/gpu/test_gpu_linear.py ;;
    gene4b32) stage gene4b32 260 python3 benchmarks/bench_generate.py --preset e4b --batch 32 \
            --systems gemma4opt-paged static_compile eager --json "$OUT/gen.jsonl" ;;
    stepcost) stage stepcost 120 python3 benchmarks/bench_plan.py --device cuda --begin-step ;;
    attntri) MAX_JOBS=16 stage attntri 300 python3 benchmarks/bench_attention.py --variants triton fa2 \
            --batch 1 8 32 64 --context 160 1024 4096 --json "$OUT/attention_triton.jsonl" ;;
    *) echo "unknown stage $s" ;;
  esac
done
