#!/usr/bin/env bash
# GPU runs as a handful of named suites. One command per GPU call: install the carried FlashInfer
# wheels (.whl/, if present) and this package, then run the named suites; each step runs under its
# own timeout and logs to $OUT/<step>.log; benchmark rows go to $OUT/<suite>.jsonl (bench_generate,
# bench_attention) or $OUT/kernels.json, in the schema of benchmarks/results/ (see
# benchmarks/results_page.py), to be appended to benchmarks/results/<suite>_<machine>.jsonl.
#
#   bash benchmarks/gpu_session.sh tests-kernels      # one suite per device call (<= 10 min each)
#   bash benchmarks/gpu_session.sh speed
#   bash benchmarks/gpu_parallel.sh "tests-gpu" "speed"   # one suite per GPU of a multi-GPU machine
#
# Suites (limits are per step; a fresh machine JIT-compiles FlashInfer first, ~30 s per kernel
# configuration, ~2-3 min for the 31b's: keep suites that share configurations back to back while
# the machine is warm):
#   tests      tests/kernels and tests/gpu but the two files below, spread over 8 pytest-xdist workers on
#              the one GPU (most of each test is compiling: Inductor, Triton, FlashInfer's JIT, which its
#              file lock keeps to one worker per configuration). Needs pytest-xdist: carry its wheel and
#              execnet's in .whl/ (pip download --no-deps pytest-xdist execnet). Limit 540 s.
#   tests-oneliner  test_gpu_generate.py and test_gpu_features.py in one process: the one-liner sizes its
#              KV pool from the memory free when it runs, so next to other workers' models it takes
#              what they then miss (limit 560 s).
#   tests-kernels  tests/kernels compiled on the GPU: every Triton kernel against its reference, the
#              PDL chain (limit 560 s: ~400 tests, ~0.7 s each on a fresh machine, most of it compiling).
#   tests-gpu  tests/gpu but the paged file: the decode kernel, generate features, fp8 ops, generate
#              (tiny variants, decode graphs, deferred stop, real dimensions), the skinny GEMM, the MoE
#              decode kernels (limit 560 s; the process's first Inductor compile took 135 s fresh).
#   tests-paged  tests/gpu/test_gpu_paged.py's FlashInfer numerics and fast replan (head_dim 256, 512
#              and 64: each new configuration JIT-compiles, ~100 s for head_dim 64 fresh; limit 560 s).
#   fused-inputs  tests/gpu/test_gpu_fp8_fused_inputs.py (quant_fp8_linear, the fp8 MLP op; 200 s), then the e4b at
#              batch 1 with fp8 weights + lm_head, with and without those fusions (bench_generate's
#              gemma4opt-fp8-head-quant-kernels; bf16 beside them; 330 s).
#   moe-streams  tests/gpu/test_gpu_moe_streams.py (the MoE layers' experts branch on a side stream in the decode
#              graphs: forks, scores bit-equal to one stream's; 220 s), then the 26b-a4b at batch 1 and 8 with and
#              without it (340 s); moe-streams-fp8: the same with fp8 weights + lm_head (400 s).
#   verify     the kernel tests of defaults first run on an H100 (norm_linear, split K at one row, rope_cos_sin,
#              the pipelined loops; 8 workers), then paged generate against eager; refresh-e2b / -e4b /
#              -26b: one preset at batch 1 against eager and HF static + compile. Carry .ficache (see below).
#   hf-fp8-e4b transformers' own FP8 path on the e4b at batch 1: its FineGrainedFP8 model, HF static cache + compile
#              and eager, its finegrained-fp8 kernel loaded from .hfkernels/ (carry it; benchmarks/hf_fp8_kernel.py),
#              beside gemma4opt's fp8 with and without the fp8 lm_head (limit 480 s). hf-fp8-26b: the same path
#              on the 26b-a4b in 64 x 64 blocks (at 128 its experts kernel refuses the experts' K of 704), HF static
#              + compile last, beside gemma4opt's fp8 + lm_head and bf16; the model rebuilt between systems (560 s).
#   fp8-block-tests, fp8-block-e4b, fp8-block-26b  FineGrainedFP8 checkpoints: the block-scaled fp8 GEMM's
#              and experts' tests on the GPU and optimized checkpoints against the reference path (300 s); the
#              e4b at batch 1 against both baselines with gemma4opt bf16, per-channel fp8 and the checkpoint
#              (400 s); the 26b-a4b at batch 1, bf16 and the checkpoint against both baselines (420 s).
#              fp8-block-sweep: the block GEMM's decode tiles at the e4b's GEMMs against the per-channel fp8 GEMM,
#              bf16 F.linear and the fp8 bytes' time (500 s; why the checkpoint decodes at 11 ms/step on the e4b).
#              fp8-block-verify: the tests, then the sweep (1 and 8 rows), in one call.
#   tests-paged-generate  the rest of it: paged generate == eager below, at and past the window,
#              sync-free decode, bucket graphs with a full pool, the fp32 refusal (limit 560 s).
#   features   HF generate features on the one-liner, in CUDA graphs (tests/gpu/test_gpu_features.py:
#              continuing a returned paged cache, assisted decoding with an optimized assistant and
#              prompt lookup, tokens == eager; limit 300 s), then bench_assisted.py: e2b drafting for
#              the 31b x 12 against the 31b alone, HF's draft schedule (limit 420 s), and 7-token drafts
#              all accepted (--accept-all, limit 300 s).
#   speed      31b x 12 layers, batch 1 and 32: the one-liner (every default), with fp8 weights, with fp8
#              weights and KV, HF static cache + torch.compile, HF eager (limit 420 s; the one-liner's
#              first generate took 168 s on a fresh machine, FlashInfer's JIT included); then, where
#              .baseline/ holds an older checkout of this repo (carry it), that code's one-liner in the
#              same call (limit 140 s), for a
#              before/after comparison on one machine. speed-batches: batch 8 and 128 of the paged mode
#              against both baselines (limit 560 s).
#   fp8        FP8: tests/gpu/test_gpu_fp8*.py (ops, fused quantizing producers, fp8 KV, the optimized fp8
#              model at real dims; limit 400 s), then bench_fp8_quality.py on the 31b x 12: KL and top-1
#              against bf16 of gemma4opt's fp8, the fp8 reference path and FineGrainedFP8's scheme (180 s).
#   speed-fp8  31b x 12, batch 1 and 32: paged bf16, fp8 weights, fp8 weights + fp8 KV, HF static cache +
#              torch.compile (limit 560 s); then e4b and 26b-a4b at batch 1 (quality, then speed, 560 s).
#   speed-presets   e4b and 26b-a4b at batch 1, paged mode vs HF static + compile vs eager
#              (limit 400 s each).
#   presets-ab-26b, presets-ab-e4b, presets-ab-e2b  one preset each (26b-a4b at batch 1 and 8, e4b at 1
#              and 32, e2b at 1): eager and the one-liner, then .baseline's one-liner in the same call
#              (limits 330 / 150, 300 / 150, 280 / 110 s, FlashInfer's JIT included in the first).
#   rows       the row kernels' warps at decode: bench_kernels.py --sweep rows on the e4b, 26b-a4b and 31b at 1-32 rows
#              (200 s), then the e4b at batch 1, bf16 and fp8 weights + lm_head, on 2-8 warps against the rule (400 s).
#   host-stacks  py-spy over profile_host.py's timed generate calls (2-layer e2b bf16, 2-layer 26b-a4b fp8): the host's
#              functions by share of its time per decode step (200 s each; needs py-spy's wheel in .whl/).
#   host-full  the host's work alone per decode step (profile_host.py --skip-replay: graphs captured, then not replayed),
#              2 layers and full depth: the e4b with fp8 weights + lm_head (240 s), in bf16 (200 s). With step-share's
#              device time and launch cost it splits a batch-1 step three ways.
#   host-stacks-e4b  the same py-spy sampling over the e4b at full depth with fp8 weights and lm_head, batch 1, where
#              generate's ms per step ran 0.9-1.5 ms over its graph's device time; idle samples kept (--idle), so
#              the host's waits (the deferred stop check's blocking event) show beside its work (limit 480 s: at
#              190 s the warm-up under the sampler had not ended).
#   direct-decode  decode steps that skip Dynamo's entry (direct_decode) against every step through it: the GPU
#              tests of the direct path (tiny variants, each direct step checked against Dynamo's guards), of
#              weights and modules replaced after optimize() and of a restrided weight (300 s),
#              then the e4b's host work alone per step at full depth in bf16 (profile_host.py --skip-replay), with
#              and without (limits 150 / 130 s). direct-e4b: the e4b at batch 1 beside eager and HF static + compile,
#              bf16 and fp8 weights + lm_head, each with and without (560 s). direct-26b: the 26b-a4b at batch 1
#              with fp8 weights + lm_head, with and without, beside eager (400 s). One call each.
#   fp8-probe  the e4b at batch 1, bf16 and fp8 weights + lm_head, PDL on and off (260 s), then the fp8 profile with
#              PDL off (200 s): why its fp8 q/k/v GEMM ran 2x its o projection's time in the live profile. One call.
#   rope       the rotary cos/sin in one launch (rope_cos_sin): its GPU tests (bits over every preset's context, a
#              graph replay) with the paged generate ones (150 s), the e4b at batch 1 in bf16 and fp8 weights + lm_head
#              with and without it, beside eager (330 s). One call.
#   pending-quick  the most of that in one call where device time is short: norm_linear's GPU tests (200 s; on
#              an H100 120 s reached 29 of them, compiling), the e4b at batch 1 in bf16: the defaults, with the
#              pipelined row sums offered, without norm_linear, beside eager (330 s; FlashInfer JIT-compiles in it).
#              pipe-tests: the pipelined row sums' bit tests (110 s; passed on an H100 at ab14225).
#   pending-fp8  the e4b at batch 1 with fp8 weights + lm_head: the defaults, with the pipelined row sums offered,
#              without norm_fp8_linear, beside eager (520 s).
#   pending-26b  the MoE decode kernels' pipelined loops swept kernel by kernel (150 s), then the 26b-a4b at batch 1:
#              the defaults, the MoE loops pipelined, the row sums' pipelined tiles offered, beside eager (400 s).
#   pending-tests-b, pending-e4b  what the CPU-only sessions built, in two calls: rope's GPU tests
#              with the paged generate ones (150 s), norm_linear's (120 s), the GEMM tests with the one-row split-K
#              tiles (120 s); the e4b at batch 1 with each of norm_linear, rope and the one-row split tiles
#              on and off, bf16 (norm_linear and rope also fp8 + lm_head), beside eager (560 s; rows measured before
#              a time-out are kept).
#   profile-e4b-fp8  kernel by kernel, PDL off: the e4b at batch 1 with fp8 weights and lm_head (200 s), then in bf16 (170 s).
#   profile-presets  kernel by kernel, PDL off: e4b at batch 32, e2b at 1, 26b-a4b at 8 (limits 190 / 130 / 200 s).
#   narrow-ab-e4b, narrow-ab-26b  the skinny GEMM's narrow tiles at 2-32 rows with and without: e4b at 32,
#              26b-a4b at 8, against eager and HF static + compile (limits 470 / 560 s).
#   presets-rest  26b-a4b at 32 and e2b at 1 against eager and HF static + compile (limits 330 / 250 s).
#   moe-grouped  the expert-by-expert MoE decode kernels: GPU and compiled kernel tests (200 s), their tiles swept at
#              32 and 64 tokens of the 26b-a4b (120 s). moe-grouped-kernels: the op against Inductor's batched
#              path at 8-64 tokens (150 s).
#   presets-26b-32  the 26b-a4b at batch 32 against eager and HF static + compile (400 s).
#   fp8-moe-prefill  fp8 experts' prefill (above 1024 (token, expert) pairs): their GPU tests (150 s), the op
#              against HF's bf16 experts at 2048 and 4096 tokens, 16-128 experts widened at once (120 s), the 26b-a4b
#              at one 2048-token prompt in bf16 and with fp8 weights + lm_head against eager (300 s), then
#              .baseline's fp8 (120 s). fp8-moe-32: the 26b-a4b at batch 32, bf16 and fp8 against eager and
#              HF static + compile (560 s).
#   moe-grouped-fp8  fp8 experts expert by expert: their GPU tests (90 s), the 26b-a4b at batch 32 in bf16 and with fp8
#              weights + lm_head (300 s).
#   moe-e2b-ab  no FlashInfer: MoE / norm_add kernel tests, the 26b-a4b MoE decode op and e2b "hf"-mode
#              tokens, this checkout then .baseline's (limits 90, 70, 100, 70, 80 s).
#   verify-moe  the MoE layer's decode kernels against their references (limit 150 s), the 26b-a4b's
#              one-liner at batch 1 and 8 against eager (330 s), its fp8 experts test (110 s).
#   probe      the MoE decode tiles swept at the 26b-a4b's shapes (150 s), the 26b-a4b at batch 1 with
#              every decode GEMM on Triton against the timed picks (200 s), e4b at 1 and 32 (230 s).
#   final-presets  GEMM pick, gate/up GEMV and MoE GPU tests (90 s), the 26b-a4b at 1 and 8 (190 s), the e4b
#              at 1 with every decode GEMM on cuBLAS beside the one-liner (220 s), all against eager.
#   fp8-head   the fp8 GEMM kernel and op tests with the fp8 lm_head's (limit 70 s), then the 31b x 12 at batch
#              1 and 32: the one-liner in bf16, with fp8 weights, with fp8 weights and lm_head, HF static cache +
#              torch.compile, HF eager (limit 480 s).
#   fp8-presets  e4b, then 26b-a4b, at batch 1: the one-liner in bf16, with fp8 weights, with fp8 weights and
#              lm_head (limit 230 s each).
#   speed-31b-full  the 60-layer 31b at batch 1, same systems (limit 590 s; 62 GB, no model copies).
#   fp8-verify  the fp8 pool's decode kernel and the fp8 experts' prefill path on the GPU against their references
#              (200 s), prefill TTFT of 8 x 2048 tokens on the 31b x 12 in bf16 and fp8 (300 s).
#   fp8-26b-eager  the 26b-a4b with fp8 weights and lm_head against eager (250 s).
#   e4b-static  the e4b at batch 1: eager, HF static cache + torch.compile, the one-liner (320 s).
#   gelu-linear  the gelu·mul inside the GEMM it feeds: its kernel and op tests (100 s), then the e4b at batch 1
#              without and with it, against eager and HF static cache + torch.compile (450 s). gelu-linear-ab: the
#              same without HF static cache + compile (70 + 210 s).
#   whole-k-ab  the skinny GEMM's whole-K tiles at one row: their kernel tests (100 s), the e4b at batch 1
#              without and with them, against eager (230 s), the 26b-a4b at batch 1 without and with (200 s).
#   speed-31b-full-fp8  the 60-layer 31b at batch 1: HF static cache + torch.compile, then fp8 weights, lm_head
#              and KV (590 s).
#   tp         on nvidia-h200-x2 only: tests/gpu/test_gpu_tensor_parallel.py (two ranks over NCCL, every
#              tiny variant, CUDA graphs capturing the all-reduces; limit 300 s), then bench_tp.py under
#              torchrun: the 31b x 12 at batch 1 and 32, gemma4opt's split against HF's tp_plan="auto"
#              with static cache + compile (needs accelerate: carry its wheel in .whl/; limit 560 s),
#              then the 60-layer 31b at batch 1 (limit 590 s).
#   kernels    bench_kernels.py: every fused Triton kernel against Inductor's code (limit 330 s), then
#              the decode GEMMs against cuBLAS (limit 300 s).
#   attention  bench_attention.py: the Triton decode kernel and FlashInfer's decode over paged KV,
#              both attention kinds, batch 1-64, context 160-4096 (limit 300 s), and the host work of
#              a decode step (bench_plan.py --begin-step, limit 120 s).
#   fp8-check  the split gelu / row quantization kernel tests (80 s), the Triton decode kernel over an fp8 pool at
#              batch 32 and 64, 4k context (60 s), the 31b x 12 at batch 1 and 32: fp8 weights and lm_head, bf16,
#              HF static cache + torch.compile, HF eager (420 s).
#   attention-fp8-final  the decode kernel's GPU tests (fp8 pool and bf16, 150 s), then its fp8 launch
#              defaults against those of commit 97eac83 (v staged in fp8: -v8), batch 1-64, context 160 and
#              4096, and the bf16 pool's default in the same run (150 s).
#   fp8-attention-26b  the Triton decode kernel over an fp8 pool, eight launch configurations with and without
#              fp16 dots, batch 1-64, and the bf16 pool's default (170 s); the 26b-a4b at batch 1, bf16 and fp8
#              weights + lm_head (280 s); the 31b x 12 fp8 decode step's kernels in order (120 s).
#   profile-layers  profile_decode.py at batch 1, PDL off, every kernel of one step in order: the 31b x 12
#              with fp8 weights and lm_head (200 s), the e4b in bf16 (170 s); then the 31b x 12 bf16 one-liner
#              with its timed GEMM picks against every decode GEMM on Triton (200 s).
#   layer-table  profile_decode.py's per-layer table (benchmarks/layer_timeline.py) of one decode step at batch 1,
#              PDL on so that each layer's time is its real one: launches, idle time and bytes against the copy
#              bandwidth per layer kind; the e4b, e2b and 26b-a4b in bf16 (170 / 130 / 200 s).
#   freed      an optimized model's device memory back after del + gc.collect (test_gpu_freed.py) and the tiny
#              variants' captured decode graphs against eager (150 s), then the e4b at batch 1 in bf16 and with fp8
#              weights + lm_head, gemma4opt alone (150 s). One call.
#   probe-tables  the e4b's fp8 profile with PDL off (fp8-probe's second half, 200 s), then the 26b-a4b's
#              live layer table (200 s), in one call.
#   layer-table-small  the same for the e4b in bf16 and with fp8 weights + lm_head, and the e2b (170 / 170 / 130 s).
#   step-share  generate's ms per step beside the decode step's device time alone (its CUDA graph replayed back to
#              back) and its launch's host time, 5 repeats each with every repeat's figure and the garbage collector's
#              time inside them: the e4b at batch 1 with fp8 weights + lm_head and in bf16 (330 s), the 26b-a4b at
#              batch 1 fp8 (200 s); the GPU's clocks before and after.
#   fp8-quality-paired  bench_fp8_quality.py on the GPU: the e4b and 26b-a4b at full depth, the 31b x 12, 2048
#              positions, KL against the anchor's paired by position (200 / 200 / 120 s).
#   fp8-quality-hf-kernel  the same on transformers' real FP8 path (hf-fp8-kernel: its FP8Linear forward on the
#              finegrained-fp8 kernel from a carried .hfkernels/) beside the emulated anchor and gemma4opt's fp8:
#              the 31b x 12, then the e4b at full depth (150 / 230 s).
#   host       profile_host.py: the host's time per decode step (2-layer e2b, and the e2b at full depth;
#              2-layer 26b-a4b with fp8 weights and lm_head; limits 240 / 200 s).
#   profile    profile_decode.py on the 31b x 12, paged mode, batch 1 and 32: device time per decode
#              step by kernel category (limits 240 / 330 s).
#
# Any step runs by hand as the command after its limit below, e.g.
#   python3 benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 32 \
#       --systems gemma4opt gemma4opt-paged static_compile eager --json rows.jsonl
#   python3 -m pytest -q tests/gpu/test_gpu_paged.py -k window
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gemma4opt-out}
mkdir -p "$OUT"
if [ -z "$GEMMA4OPT_SKIP_INSTALL" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
[ -n "$GEMMA4OPT_SKIP_INSTALL" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2

# FlashInfer's JIT output (~140 s to build on a fresh machine): each kernel library it built
# (cached_ops/<name>/<name>.so under ~/.cache/flashinfer) goes back out as $OUT/0_flashinfer-so.tgz
# when that fits the 16 MiB a returned file may hold (named to sort first: a call returns its first 8
# files by name). Carried in as .ficache/flashinfer-so.tgz (.ficache/ git-ignored), it is unpacked
# into FlashInfer's AOT directory, which it loads from without building: its JIT directory would
# be rebuilt by ninja, the freshly installed sources being newer than the libraries.
FI_CACHE=$HOME/.cache/flashinfer
if [ -f .ficache/flashinfer-so.tgz ]; then
  FI_AOT=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)" 2>/dev/null) &&
    mkdir -p "$FI_AOT" && tar -xzf .ficache/flashinfer-so.tgz -C "$FI_AOT" &&
    echo "FlashInfer kernels unpacked into $FI_AOT: $(tar -tzf .ficache/flashinfer-so.tgz | wc -l) libraries"
fi
save_fi_cache() {
  local tgz=$OUT/0_flashinfer-so.tgz ops
  ops=$(find "$FI_CACHE" -type d -name cached_ops 2>/dev/null | head -1)
  [ -n "$ops" ] || return 0
  (cd "$ops" && find . -name '*.so' | tar -czf "$tgz" -T - 2>/dev/null)
  [ "$(stat -c %s "$tgz" 2>/dev/null || echo 0)" -le 16000000 ] || rm -f "$tgz"
}
trap save_fi_cache EXIT
trap 'exit 143' TERM        # a call's time limit: still save what was built

stage() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/$name.log" | tail -40
  echo "== $name rc=${PIPESTATUS[0]}"
}
# -v: one line per test as it ends, so a step stopped by its limit still says what ran and passed.
PYTEST="python3 -m pytest -v -rfE --durations=10 -p no:cacheprovider -p no:logging --tb=short"
GEN="python3 benchmarks/bench_generate.py --preset"
PAGED_KERNELS="flashinfer_matches_reference or fast_replan"
# Suites made of others' stages, expanded before the loop.
parts() {
  case $1 in
    rope) echo rope-tests rope-e4b ;;
    fp8-probe) echo fp8-pdl-e4b profile-e4b-fp8-only ;;
    probe-tables) echo profile-e4b-fp8-only layer-table-26b ;;
    freed) echo freed-tests freed-e4b ;;
    pending-quick) echo norm-linear-tests quick-e4b ;;
    pending-fp8) echo fp8-e4b-pipe ;;
    pending-26b) echo moe-pipe-sweep pipe-26b ;;
    pending-tests-b) echo rope-tests norm-linear-tests row-split-tests ;;
    e2b-and-31b-paged) echo refresh-e2b paged-31b ;;
    *) echo "$1" ;;
  esac
}
for s in $(for a in "$@"; do parts "$a"; done); do
  case $s in
    tests) stage tests 540 $PYTEST -n 8 tests/gpu tests/kernels --ignore=tests/gpu/test_gpu_generate.py \
             --ignore=tests/gpu/test_gpu_features.py ;;
    tests-oneliner) MAX_JOBS=16 stage tests-oneliner 560 $PYTEST -s tests/gpu/test_gpu_generate.py \
             tests/gpu/test_gpu_features.py ;;
    tests-kernels) stage tests-kernels 560 $PYTEST tests/kernels ;;
    tests-gpu) stage tests-gpu 560 $PYTEST tests/gpu --ignore=tests/gpu/test_gpu_paged.py ;;
    tests-paged) MAX_JOBS=16 stage tests-paged 560 $PYTEST -s tests/gpu/test_gpu_paged.py -k "$PAGED_KERNELS" ;;
    tests-paged-generate)
      MAX_JOBS=16 stage tests-paged-generate 560 $PYTEST -s tests/gpu/test_gpu_paged.py -k "not ($PAGED_KERNELS)" ;;
    speed)
      stage speed-oneliner 420 $GEN 31b --layers 12 --batch 1 32 --systems gemma4opt gemma4opt-fp8 \
            gemma4opt-fp8-kv8 static_compile eager --json "$OUT/generate.jsonl"
      if [ -d .baseline/gemma4opt ]; then
        (cd .baseline && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} &&
         stage speed-before 140 $GEN 31b --layers 12 --batch 1 32 --systems gemma4opt --json "$OUT/generate_before.jsonl")
      fi ;;
    speed-batches)
      stage speed-batches 560 $GEN 31b --layers 12 --batch 8 128 \
            --systems gemma4opt-paged static_compile eager --json "$OUT/generate.jsonl" ;;
    fp8)
      stage fp8-tests 400 $PYTEST -s tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_fp8_kv.py
      stage fp8-quality 180 python3 benchmarks/bench_fp8_quality.py --preset 31b --layers 12 \
            --json "$OUT/fp8_quality.jsonl" ;;
    speed-fp8)
      stage speed-fp8 560 $GEN 31b --layers 12 --batch 1 32 --systems gemma4opt-paged gemma4opt-paged-fp8 \
            gemma4opt-paged-fp8-kv8 static_compile --json "$OUT/generate.jsonl"
      stage speed-fp8-presets 560 bash -c "for p in e4b 26b-a4b; do python3 benchmarks/bench_fp8_quality.py \
            --preset \$p --json $OUT/fp8_quality.jsonl; $GEN \$p --batch 1 --systems gemma4opt-paged \
            gemma4opt-paged-fp8-kv8 --json $OUT/generate.jsonl; done" ;;
    presets-ab-26b|presets-ab-e4b|presets-ab-e2b)
      # One preset at its goal batches on this checkout (with eager: tokens compared), then on .baseline's
      # older checkout in the same call: a before/after on one machine. Limits from a fresh H200: the
      # 26b-a4b's first one-liner took ~300 s with FlashInfer's JIT (~140 s of it), its second ~120 s.
      case $s in
        presets-ab-26b) p=26b-a4b; b="1 8"; lim_new=330; lim_old=150 ;;
        presets-ab-e4b) p=e4b; b="1 32"; lim_new=300; lim_old=150 ;;
        *) p=e2b; b="1"; lim_new=280; lim_old=110 ;;
      esac
      stage presets-$p "$lim_new" $GEN $p --batch $b --systems eager gemma4opt --json "$OUT/generate.jsonl"
      if [ -d .baseline/gemma4opt ]; then
        (cd .baseline && ln -sfn ../patterns gemma4opt/patterns && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} &&
         stage presets-$p-before "$lim_old" $GEN $p --batch $b --systems gemma4opt --json "$OUT/generate_before.jsonl")
      fi ;;
    verify-moe)
      # The MoE layer's decode kernels compiled against their references (router input, router + experts'
      # norm, experts, norm_add, the norm kernels' shared inv_rms), then the 26b-a4b's one-liner at batch 1
      # and 8 against eager (tokens compared), then the fp8 experts at 26b-a4b dimensions.
      stage moe-kernel-tests 150 $PYTEST tests/kernels/test_moe_router_kernel.py tests/kernels/test_norm_add_kernel.py \
            tests/kernels/test_rms_norm_kernel.py tests/kernels/test_moe_experts_kernel.py tests/gpu/test_gpu_moe_experts.py
      stage presets-26b-a4b 330 $GEN 26b-a4b --batch 1 8 --systems eager gemma4opt --json "$OUT/generate.jsonl"
      stage fp8-moe 110 $PYTEST -s tests/gpu/test_gpu_fp8.py -k "26b" ;;
    probe)
      # Where the next launches and bytes are: the MoE decode kernels' tiles at the 26b-a4b's shapes; the
      # 26b-a4b at batch 1 with every decode GEMM on the Triton GEMM against the timed picks; the e4b's
      # one-liner at batch 1 and 32 against eager.
      stage moe-sweep 150 python3 benchmarks/bench_kernels.py --sweep moe --presets 26b-a4b --m 1 8 \
            --json "$OUT/sweep_moe.jsonl"
      stage picks-26b 200 $GEN 26b-a4b --batch 1 --systems gemma4opt-triton-gemms gemma4opt --json "$OUT/generate.jsonl"
      stage presets-e4b 230 $GEN e4b --batch 1 32 --systems eager gemma4opt --json "$OUT/generate.jsonl" ;;
    final-presets)
      # The decode GEMM picks, the fused gate/up GEMV and the MoE tiles on the GPU (tests), then the 26b-a4b at
      # batch 1 and 8 and the e4b at 1 against eager, the e4b with every decode GEMM on cuBLAS beside it.
      stage final-gpu-tests 90 $PYTEST tests/gpu/test_gpu_linear.py tests/gpu/test_gpu_moe_experts.py \
            tests/kernels/test_gate_up_gelu_kernel.py tests/kernels/test_moe_experts_kernel.py
      stage final-26b-a4b 190 $GEN 26b-a4b --batch 1 8 --systems eager gemma4opt --json "$OUT/generate.jsonl"
      stage final-e4b 220 $GEN e4b --batch 1 --systems eager gemma4opt-paged-cublas gemma4opt \
            --json "$OUT/generate.jsonl" ;;
    fp8-head)
      # The skinny fp8 GEMM's one-row tensor-core tiles, its softcap epilogue, the graph-timed picks and the
      # fp8 lm_head at the 31b's dimensions (tests), then the 31b x 12 at batch 1 and 32: bf16, fp8 weights,
      # fp8 weights and lm_head, against HF static cache + compile and eager.
      stage fp8-head-tests 70 $PYTEST tests/kernels/test_fp8_linear_kernel.py tests/gpu/test_gpu_fp8.py \
            -k "one_row or softcap or lm_head or both_branches"
      stage fp8-head-31b 480 $GEN 31b --layers 12 --batch 1 32 --systems gemma4opt-fp8-head gemma4opt-fp8 gemma4opt \
            static_compile eager --json "$OUT/generate.jsonl" ;;
    fp8-presets)
      stage fp8-e4b 230 $GEN e4b --batch 1 --systems gemma4opt gemma4opt-fp8 gemma4opt-fp8-head --json "$OUT/generate.jsonl"
      stage fp8-26b-a4b 230 $GEN 26b-a4b --batch 1 --systems gemma4opt gemma4opt-fp8 gemma4opt-fp8-head \
            --json "$OUT/generate.jsonl" ;;
    moe-e2b-ab)
      # No FlashInfer JIT (a fresh machine's ~140 s): the MoE decode kernels and norm_add compiled against
      # their references; the 26b-a4b's MoE decode op on this checkout and .baseline's (CUDA-graph
      # replays); e2b tokens against eager in the "hf" mode, this checkout and .baseline's.
      stage moe-kernel-tests 90 $PYTEST tests/kernels/test_moe_experts_kernel.py tests/kernels/test_norm_add_kernel.py
      stage moe-kernel 70 python3 benchmarks/bench_kernels.py --presets 26b-a4b --m 1 8 --only moe_experts \
            --json "$OUT/kernels_moe.json"
      stage e2b-hf 100 $GEN e2b --batch 1 --systems eager gemma4opt-hf --json "$OUT/generate.jsonl"
      if [ -d .baseline/gemma4opt ]; then
        ln -sfn ../patterns .baseline/gemma4opt/patterns
        (export PYTHONPATH=$PWD/.baseline${PYTHONPATH:+:$PYTHONPATH} &&
         stage moe-kernel-before 70 python3 benchmarks/bench_kernels.py --presets 26b-a4b --m 1 8 --only moe_experts \
               --json "$OUT/kernels_moe_before.json" &&
         cd .baseline && stage e2b-hf-before 80 $GEN e2b --batch 1 --systems eager gemma4opt-hf \
               --json "$OUT/generate_before.jsonl")
      fi ;;
    speed-presets)
      stage speed-e4b 400 $GEN e4b --batch 1 --systems gemma4opt-paged static_compile eager --json "$OUT/generate.jsonl"
      stage speed-26b 400 $GEN 26b-a4b --batch 1 --systems eager static_compile gemma4opt-paged --json "$OUT/generate.jsonl" ;;
    speed-31b-full)
      stage speed-31b-full 590 $GEN 31b --batch 1 --systems eager static_compile gemma4opt-paged \
            --json "$OUT/generate.jsonl" ;;   # 62 GB: gemma4opt last, on the model itself
    fp8-verify)
      # The fp8 pool's decode (fp16 dots, wide tiles) and the fp8 experts' prefill path compiled against their
      # references; prefill TTFT of 8 x 2048 tokens on the 31b x 12, bf16 against fp8; the 26b-a4b's fp8
      # prefill and decode against eager.
      stage fp8-verify-tests 200 $PYTEST tests/gpu/test_gpu_fp8_kv.py tests/gpu/test_gpu_moe_experts.py \
            tests/kernels/test_paged_decode_kernel.py tests/kernels/test_moe_experts_kernel.py -k "fp8"
      stage fp8-prefill-31b 300 $GEN 31b --layers 12 --batch 8 --prompt 2048 --new 8 --systems gemma4opt-paged \
            gemma4opt-paged-fp8 --json "$OUT/generate.jsonl" ;;
    fp8-26b-eager)
      stage fp8-26b-a4b-eager 250 $GEN 26b-a4b --batch 1 --systems eager gemma4opt-fp8-head --json "$OUT/generate.jsonl" ;;
    e4b-static)
      stage e4b-static 320 $GEN e4b --batch 1 --systems eager static_compile gemma4opt --json "$OUT/generate.jsonl" ;;
    gelu-linear)
      # The gelu·mul made inside the GEMM it feeds (PLE projection, MLP down): the kernels and ops compiled
      # against their references, then the e4b at batch 1 without and with it, against eager and HF static
      # cache + torch.compile.
      stage gelu-linear-tests 100 $PYTEST tests/gpu/test_gpu_linear.py tests/kernels/test_skinny_linear_kernel.py -k gelu
      stage gelu-linear-e4b 450 $GEN e4b --batch 1 --systems eager static_compile gemma4opt-no-gelu-linear gemma4opt \
            --json "$OUT/generate.jsonl" ;;
    gelu-linear-ab)     # the same without HF static cache + compile (a short device budget)
      stage gelu-linear-tests 70 $PYTEST tests/gpu/test_gpu_linear.py tests/kernels/test_skinny_linear_kernel.py -k gelu
      stage gelu-linear-e4b 210 $GEN e4b --batch 1 --systems eager gemma4opt-no-gelu-linear gemma4opt \
            --json "$OUT/generate.jsonl" ;;
    whole-k-ab)     # the one-row GEMM tiles that load all of K at once: with and without them
      stage whole-k-tests 100 $PYTEST tests/kernels/test_skinny_linear_kernel.py -k "whole_k or matches_f_linear"
      stage whole-k-e4b 230 $GEN e4b --batch 1 --systems eager gemma4opt-no-whole-k gemma4opt \
            --json "$OUT/generate.jsonl"
      stage whole-k-26b 200 $GEN 26b-a4b --batch 1 --systems gemma4opt-no-whole-k gemma4opt \
            --json "$OUT/generate.jsonl" ;;
    narrow-ab-e4b)      # the narrow tiles at 2-32 rows (16-32 W rows, K split up to 16 ways): with and without
      stage narrow-tests 90 $PYTEST tests/kernels/test_skinny_linear_kernel.py -k "narrow or split or explicit"
      stage narrow-e4b 470 $GEN e4b --batch 32 --systems eager gemma4opt-no-narrow gemma4opt static_compile \
            --json "$OUT/generate.jsonl" ;;
    narrow-ab-26b)
      stage narrow-26b 560 $GEN 26b-a4b --batch 8 --systems eager gemma4opt-no-narrow gemma4opt static_compile \
            --json "$OUT/generate.jsonl" ;;
    presets-rest)       # the preset rows not yet measured against both baselines: 26b-a4b at 32, e2b at 1
      stage presets-26b-32 330 $GEN 26b-a4b --batch 32 --systems eager gemma4opt static_compile --json "$OUT/generate.jsonl"
      stage presets-e2b 250 $GEN e2b --batch 1 --systems eager gemma4opt static_compile --json "$OUT/generate.jsonl" ;;
    moe-grouped)        # the expert-by-expert MoE decode kernels: tests, tile sweep, the op against HF's batched path
      stage moe-grouped-tests 200 $PYTEST tests/gpu/test_gpu_moe_experts.py tests/kernels/test_moe_grouped_kernel.py \
            tests/kernels/test_moe_experts_kernel.py
      stage moe-grouped-sweep 120 python3 benchmarks/bench_kernels.py --sweep moe_grouped --presets 26b-a4b --m 32 64 \
            --json "$OUT/sweep.jsonl" ;;
    moe-grouped-kernels)  # the MoE decode op against Inductor's batched path at 8-64 tokens of the 26b-a4b
      stage moe-grouped-kernels 150 python3 benchmarks/bench_kernels.py --presets 26b-a4b --m 8 16 32 64 --only moe_experts \
            --json "$OUT/kernels.json" ;;
    moe-grouped-fp8)    # fp8 experts expert by expert: their GPU tests, the 26b-a4b at 32 in bf16 and with fp8 weights + lm_head
      stage moe-grouped-fp8-tests 90 $PYTEST tests/gpu/test_gpu_moe_experts.py -k fp8
      stage moe-grouped-fp8-26b-32 300 $GEN 26b-a4b --batch 32 --systems gemma4opt gemma4opt-fp8-head \
            --json "$OUT/generate.jsonl" ;;
    fp8-moe-prefill)    # fp8 experts above 1024 pairs (prefill): tests; the 26b-a4b, one 2048-token prompt,
      # bf16 and fp8 weights + lm_head against eager, then .baseline's fp8 in the same call
      stage fp8-moe-prefill-tests 150 $PYTEST tests/gpu/test_gpu_moe_experts.py -k fp8
      stage widen-e4m3-tests 60 $PYTEST tests/kernels/test_widen_e4m3_kernel.py
      stage fp8-moe-prefill-op 120 python3 benchmarks/bench_moe_prefill.py --tokens 2048 4096 --groups 16 32 128 \
            --top 8 --json "$OUT/moe_prefill.jsonl"
      stage fp8-moe-prefill-2048 300 $GEN 26b-a4b --batch 1 --prompt 2048 --new 16 --systems eager gemma4opt \
            gemma4opt-fp8-head --json "$OUT/generate.jsonl"
      if [ -d .baseline/gemma4opt ]; then
        (cd .baseline && ln -sfn ../patterns gemma4opt/patterns && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} &&
         stage fp8-moe-prefill-2048-before 120 $GEN 26b-a4b --batch 1 --prompt 2048 --new 16 \
               --systems gemma4opt-fp8-head --json "$OUT/generate_before.jsonl")
      fi ;;
    fp8-moe-32)         # the 26b-a4b at batch 32 (4096 prompt tokens: fp8 prefill above 1024 pairs), bf16 and
      # fp8 weights + lm_head against eager and HF static + compile
      stage fp8-moe-32 560 $GEN 26b-a4b --batch 32 --new 32 --systems eager gemma4opt gemma4opt-fp8-head \
            static_compile --json "$OUT/generate.jsonl" ;;
    presets-26b-32)     # the 26b-a4b at batch 32 against eager and HF static + compile
      stage presets-26b-32 400 $GEN 26b-a4b --batch 32 --systems eager gemma4opt static_compile --json "$OUT/generate.jsonl" ;;
    speed-31b-full-fp8)
      # 60 layers with fp8 weights, lm_head and KV: quantized in place (last), one bf16 module at a time.
      stage speed-31b-full-fp8 590 $GEN 31b --batch 1 --systems static_compile gemma4opt-fp8-kv8-head \
            --json "$OUT/generate.jsonl" ;;
    tp)
      MAX_JOBS=16 stage tp-tests 300 $PYTEST -s tests/gpu/test_gpu_tensor_parallel.py
      stage tp-31b 560 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_tp.py --preset 31b \
            --layers 12 --batch 1 32 --json "$OUT/generate.jsonl"
      stage tp-31b-full 590 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_tp.py \
            --preset 31b --batch 1 --json "$OUT/generate.jsonl" ;;
    kernels)
      stage kernels 330 python3 benchmarks/bench_kernels.py --json "$OUT/kernels.json"
      stage kernels-linear 300 python3 benchmarks/bench_kernels.py --linear --presets 31b e4b --m 1 8 32 \
            --json "$OUT/linear.json" ;;
    attention)
      MAX_JOBS=16 stage attention 300 python3 benchmarks/bench_attention.py --variants triton fa2 \
            --batch 1 8 32 64 --context 160 1024 4096 --json "$OUT/attention.jsonl"
      stage attention-host 120 python3 benchmarks/bench_plan.py --device cuda --begin-step ;;
    profile)
      stage profile-1 240 python3 benchmarks/profile_decode.py --preset 31b --layers 12 --new 32 --attention paged
      stage profile-32 330 python3 benchmarks/profile_decode.py --preset 31b --layers 12 --new 32 --batch 32 \
            --attention paged ;;
    fp8-check)
      # The split gelu / row quantization compiled against the references; the Triton decode kernel over an
      # fp8 pool at batch 32 and 64, 4k context; the 31b x 12 with fp8 weights and lm_head against bf16,
      # HF static cache + compile and eager.
      stage fp8-quant-tests 80 $PYTEST tests/kernels/test_fp8_quant_kernel.py -k "gelu or quantize_rows"
      stage attention-fp8 60 python3 benchmarks/bench_attention.py --variants triton --kv-dtype fp8 --batch 32 64 \
            --context 4096 --json "$OUT/attention.jsonl"
      stage fp8-31b 420 $GEN 31b --layers 12 --batch 1 32 --systems gemma4opt-fp8-head gemma4opt static_compile eager \
            --json "$OUT/generate.jsonl" ;;
    attention-fp8-final)
      stage tests-decode-kernel 150 $PYTEST tests/gpu/test_gpu_decode_kernel.py tests/gpu/test_gpu_fp8_kv.py
      V="triton triton-b32-w4-s2-f16-v8 triton-b64-w4-s2-f16-v8 triton-b64-w8-s2-f16-v8 triton-b16-w8-s2-f16-v8"
      stage attention-fp8-final 150 bash -c "python3 benchmarks/bench_attention.py --variants $V --kv-dtype fp8 \
            --batch 1 8 32 64 --context 160 4096 --json $OUT/attention.jsonl && python3 benchmarks/bench_attention.py \
            --variants triton --batch 1 8 32 64 --context 160 4096 --json $OUT/attention.jsonl" ;;
    fp8-attention-26b)
      # The Triton decode kernel over an fp8 pool: launch configurations and fp16 dots, against the bf16 pool's
      # default in the same run; then the 26b-a4b at batch 1, bf16 against fp8 weights and lm_head; then the
      # 31b x 12 fp8 decode step's kernels in order (PDL off).
      V="triton triton-f16 triton-b64-w4-s2 triton-b64-w4-s2-f16 triton-b64-w8-s2-f16 triton-b32-w8-s3-f16 \
         triton-b128-w8-s2-f16 triton-b16-w8-s2-f16"
      stage attention-fp8-sweep 170 bash -c "python3 benchmarks/bench_attention.py --variants $V --kv-dtype fp8 \
            --batch 32 64 --context 4096 --json $OUT/attention.jsonl && python3 benchmarks/bench_attention.py \
            --variants $V --kv-dtype fp8 --batch 1 --context 160 4096 --json $OUT/attention.jsonl && \
            python3 benchmarks/bench_attention.py --variants triton --batch 1 32 64 --context 160 4096 \
            --json $OUT/attention.jsonl"
      stage fp8-26b-a4b 280 $GEN 26b-a4b --batch 1 --systems gemma4opt gemma4opt-fp8-head --json "$OUT/generate.jsonl"
      GEMMA4OPT_PDL=0 stage profile-31b-fp8 120 python3 benchmarks/profile_decode.py --preset 31b --layers 12 \
            --new 16 --attention paged --quantization fp8 --quantize-lm-head --per-category 30 ;;
    profile-layers)
      # Kernel by kernel, in order, one decode step at batch 1 with programmatic dependent launch off
      # (with it on, a kernel starts early and waits, so its profiled time includes its producer's).
      GEMMA4OPT_PDL=0 stage profile-31b-fp8 200 python3 benchmarks/profile_decode.py --preset 31b --layers 12 \
            --new 16 --attention paged --quantization fp8 --quantize-lm-head --per-category 30
      GEMMA4OPT_PDL=0 stage profile-e4b 170 python3 benchmarks/profile_decode.py --preset e4b --new 16 \
            --attention paged --per-category 30
      stage bf16-picks-31b 180 $GEN 31b --layers 12 --batch 1 --systems gemma4opt gemma4opt-triton-gemms \
            --json "$OUT/generate.jsonl" ;;
    layer-table)
      for p in e4b:170 e2b:130 26b-a4b:200; do
        stage layer-table-${p%:*} ${p#*:} python3 benchmarks/profile_decode.py --preset ${p%:*} --new 16 \
              --attention paged --per-category 12
      done ;;
    freed-tests)        # an optimized model's memory back after del; the tiny variants' decode graphs == eager; a deep copy
      stage freed-tests 200 $PYTEST tests/gpu/test_gpu_freed.py tests/gpu/test_gpu_generate.py \
            tests/gpu/test_gpu_features.py -k "freed or (tiny_variants and captured) or deep_copy or pickled" ;;
    freed-e4b)          # the e4b at batch 1, bf16 and fp8 weights + lm_head, no baseline (a short device budget)
      stage freed-e4b 150 $GEN e4b --batch 1 --systems gemma4opt gemma4opt-fp8-head --json "$OUT/generate.jsonl" ;;
    layer-table-26b)    # the 26b-a4b in bf16 alone
      stage layer-table-26b-a4b 200 python3 benchmarks/profile_decode.py --preset 26b-a4b --new 16 \
            --attention paged --per-category 12 ;;
    layer-table-e4b)    # the e4b in bf16 alone
      stage layer-table-e4b 170 python3 benchmarks/profile_decode.py --preset e4b --new 16 --attention paged \
            --per-category 12 ;;
    layer-table-small)  # the e4b in bf16 and with fp8 weights + lm_head, then the e2b, in one call
      stage layer-table-e4b 170 python3 benchmarks/profile_decode.py --preset e4b --new 16 --attention paged \
            --per-category 12
      stage layer-table-e4b-fp8 170 python3 benchmarks/profile_decode.py --preset e4b --new 16 --attention paged \
            --per-category 12 --quantization fp8 --quantize-lm-head
      stage layer-table-e2b 130 python3 benchmarks/profile_decode.py --preset e2b --new 16 --attention paged \
            --per-category 12 ;;
    fp8-quality-paired)
      # FP8 quality at depth on the GPU (gemma4opt's fp8 kernels, not the CPU references): the e4b and 26b-a4b at
      # full depth, then the 31b x 12, 8 x 256 teacher-forced positions, each KL against the anchor's paired by
      # position (limits 200 / 200 / 120 s).
      for p in e4b 26b-a4b; do
        stage fp8-quality-$p 200 python3 benchmarks/bench_fp8_quality.py --preset $p --batch 8 --seq 256 \
              --systems hf-finegrained-fp8 gemma4opt-fp8 gemma4opt-fp8-head --json "$OUT/fp8_quality.jsonl"
      done
      stage fp8-quality-31b 120 python3 benchmarks/bench_fp8_quality.py --preset 31b --layers 12 --batch 8 --seq 256 \
            --systems hf-finegrained-fp8 gemma4opt-fp8 gemma4opt-fp8-head --json "$OUT/fp8_quality.jsonl" ;;
    fp8-quality-hf-kernel)
      stage fp8-quality-hf-31b 150 python3 benchmarks/bench_fp8_quality.py --preset 31b --layers 12 --batch 8 --seq 256 \
            --systems hf-finegrained-fp8 hf-fp8-kernel gemma4opt-fp8 gemma4opt-fp8-head --json "$OUT/fp8_quality.jsonl"
      stage fp8-quality-hf-e4b 230 python3 benchmarks/bench_fp8_quality.py --preset e4b --batch 8 --seq 256 \
            --systems hf-finegrained-fp8 hf-fp8-kernel gemma4opt-fp8 --json "$OUT/fp8_quality.jsonl" ;;
    step-share)
      CLOCKS="nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv"
      stage step-share-clocks 20 $CLOCKS
      stage step-share-e4b 330 $GEN e4b --batch 1 --repeats 5 --systems gemma4opt-fp8-head gemma4opt \
            --json "$OUT/generate.jsonl"
      stage step-share-26b 200 $GEN 26b-a4b --batch 1 --repeats 5 --systems gemma4opt-fp8-head \
            --json "$OUT/generate.jsonl"
      stage step-share-clocks-after 20 $CLOCKS ;;
    rows)
      # The row kernels' warps at decode: swept per kernel on three presets (one row to 32), then the e4b at batch 1
      # end to end with every row kernel on 2, 4 or 8 warps against row_launch's rule (16 at its 2560 columns).
      stage rows-sweep 200 python3 benchmarks/bench_kernels.py --sweep rows --presets e4b 26b-a4b 31b --m 1 8 32 \
            --json "$OUT/sweeps.jsonl"
      stage rows-e4b 400 $GEN e4b --batch 1 --systems gemma4opt-fp8-head gemma4opt-fp8-head-rows2 \
            gemma4opt-fp8-head-rows4 gemma4opt-fp8-head-rows8 gemma4opt gemma4opt-rows4 --json "$OUT/generate.jsonl" ;;
    host-stacks)
      # Where the host's time per decode step goes: py-spy (carry its wheel in .whl/) samples profile_host.py's
      # timed generate calls on 2-layer models, e2b in bf16 and the 26b-a4b with fp8 weights and lm_head.
      SPY=/tmp/site/bin/py-spy
      stage host-stacks-e2b 200 $SPY record --format raw -o "$OUT/host_e2b.folded" --rate 500 -- \
            python3 benchmarks/profile_host.py --preset e2b --layers 2 --new 256
      stage host-stacks-e2b-top 30 python3 benchmarks/profile_host.py --stacks "$OUT/host_e2b.folded" --top 70
      stage host-stacks-26b 200 $SPY record --format raw -o "$OUT/host_26b.folded" --rate 500 -- \
            python3 benchmarks/profile_host.py --preset 26b-a4b --layers 2 --quantization fp8 --quantize-lm-head --new 256
      stage host-stacks-26b-top 30 python3 benchmarks/profile_host.py --stacks "$OUT/host_26b.folded" --top 70 ;;
    host-full)
      stage host-full-e4b-fp8 240 python3 benchmarks/profile_host.py --preset e4b --quantization fp8 --quantize-lm-head \
            --skip-replay --full --json "$OUT/host.jsonl"
      stage host-full-e4b 200 python3 benchmarks/profile_host.py --preset e4b --skip-replay --full --json "$OUT/host.jsonl" ;;
    direct-decode)
      stage direct-tests 300 $PYTEST tests/gpu/test_gpu_generate.py -k "direct or replaced_after or restrided"
      HOST="python3 benchmarks/profile_host.py --preset e4b --layers 42 --skip-replay"
      stage direct-host 150 $HOST --json "$OUT/host.jsonl"
      stage direct-host-off 130 $HOST --no-direct --json "$OUT/host.jsonl" ;;
    # fp8-probe: why the e4b's fp8 q/k/v GEMM took 8.0 µs for 7.9 MB in the live H100 profile where its o
    # projection took 3.7 for 5.2 (profile_e4b_fp8_pdl_h100.txt): the e4b at batch 1, bf16 and fp8 weights +
    # lm_head, each with programmatic dependent launch on and off, beside eager (260 s); then the fp8 profile
    # with it off, where each kernel's time is its own (200 s).
    fp8-pdl-e4b)
      stage fp8-pdl-e4b 260 $GEN e4b --batch 1 --systems eager gemma4opt gemma4opt-paged-nopdl gemma4opt-fp8-head \
            gemma4opt-fp8-head-nopdl --json "$OUT/generate.jsonl" ;;
    profile-e4b-fp8-only)
      GEMMA4OPT_PDL=0 stage profile-e4b-fp8 200 python3 benchmarks/profile_decode.py --preset e4b --new 16 \
            --attention paged --quantization fp8 --quantize-lm-head --per-category 12 ;;
    # Every kernel test of the defaults not yet run on this GPU kind, 8 at a time (norm_linear, the one-row split
    # GEMM, rope_cos_sin's bits, the pipelined loops; 330 s), then the paged generate tests that compare tokens
    # with eager, rope_cos_sin in them (FlashInfer's JIT included: 260 s).
    verify)
      stage verify-kernels 330 $PYTEST -n 8 tests/gpu/test_gpu_norm_linear.py tests/kernels/test_norm_linear_kernel.py \
            tests/kernels/test_norm_fp8_linear_kernel.py tests/gpu/test_gpu_linear.py tests/kernels/test_skinny_linear_kernel.py \
            tests/gpu/test_gpu_rope.py tests/gpu/test_gpu_pipelined.py
      MAX_JOBS=16 stage verify-paged 260 $PYTEST -s tests/gpu/test_gpu_paged.py -k "rope or paged_generate_equals_eager or \
            do_not_sync or bucket_graphs" ;;
    # FineGrainedFP8 checkpoints, a call each: the block-scaled GEMM, the experts op and optimized e4b / 31b /
    # 26b-a4b checkpoints against the reference path (300 s); the e4b at batch 1: eager, HF static + compile,
    # gemma4opt bf16, per-channel fp8 and the FineGrainedFP8 checkpoint (400 s; HF's own FP8 path needs the
    # kernels hub).
    fp8-block-tests)
      stage fp8-block-tests 300 $PYTEST -s tests/gpu/test_gpu_fp8_block.py tests/kernels/test_fp8_block_linear_kernel.py ;;
    hf-fp8-e4b)
      # transformers' own FP8 path (FineGrainedFP8, its finegrained-fp8 Triton kernel from a carried .hfkernels/
      # copy: benchmarks/hf_fp8_kernel.py) with HF static cache + compile and eager, beside gemma4opt's fp8.
      # HF_FP8_SYSTEMS / HF_FP8_LIMIT / HF_FP8_ARGS (e.g. --layers 12): fewer systems, a shorter limit, a
      # shallower model for a short device budget.
      stage hf-fp8-e4b "${HF_FP8_LIMIT:-480}" $GEN e4b --batch 1 ${HF_FP8_ARGS:-} --systems \
            ${HF_FP8_SYSTEMS:-gemma4opt-fp8-head gemma4opt-fp8 hf-fp8-static hf-fp8} --json "$OUT/generate.jsonl" ;;
    hf-fp8-26b)
      stage hf-fp8-26b "${HF_FP8_LIMIT:-560}" $GEN 26b-a4b --batch 1 --rebuild --fp8-block 64 ${HF_FP8_ARGS:-} \
            --systems ${HF_FP8_SYSTEMS:-gemma4opt-fp8-head gemma4opt hf-fp8-static} --json "$OUT/generate.jsonl" ;;
    fp8-block-e4b)
      stage fp8-block-e4b 400 $GEN e4b --batch 1 --systems eager static_compile gemma4opt gemma4opt-fp8 \
            gemma4opt-finegrained-fp8 --json "$OUT/generate.jsonl" ;;
    fp8-block-quick)    # both of the above in one call for a short device budget: the tests, then the e4b without
                        # per-channel fp8 and HF static + compile last (its rows kept if the call's limit ends it)
      stage fp8-block-tests 220 $PYTEST -s tests/gpu/test_gpu_fp8_block.py tests/kernels/test_fp8_block_linear_kernel.py
      stage fp8-block-e4b 330 $GEN e4b --batch 1 --systems eager gemma4opt gemma4opt-finegrained-fp8 static_compile \
            --json "$OUT/generate.jsonl" ;;
    fp8-block-sweep)    # the block GEMM's decode tiles at the e4b's shapes beside per-channel fp8 and bf16 (1 and 8 rows)
      stage fp8-block-sweep 500 python3 benchmarks/bench_kernels.py --sweep-fp8-block --presets e4b --m 1 8 \
            --json "$OUT/fp8_block_sweep.jsonl" ;;
    fp8-block-verify)   # the block GEMM's GPU tests, then its tile sweep (1 and 8 rows), in one call
      stage fp8-block-tests 300 $PYTEST -s tests/gpu/test_gpu_fp8_block.py tests/kernels/test_fp8_block_linear_kernel.py
      stage fp8-block-sweep 270 python3 benchmarks/bench_kernels.py --sweep-fp8-block --presets e4b --m 1 8 \
            --json "$OUT/fp8_block_sweep.jsonl" ;;
    fp8-block-profile)  # the e4b checkpoint's decode step kernel by kernel (profile_decode.py), 42 and 4 layers
      stage fp8-block-profile 300 python3 benchmarks/profile_decode.py --preset e4b --attention paged --fp8-block 128
      stage fp8-block-profile-l4 120 python3 benchmarks/profile_decode.py --preset e4b --layers 4 --attention paged \
            --fp8-block 128 ;;
    fp8-block-26b)      # the 26b-a4b's FP8Experts at decode (the pairs GEMMs), against eager and HF static + compile
      # (last: its compile is the longest part; on an H100 the model is rebuilt between systems, --rebuild)
      stage fp8-block-26b 420 $GEN 26b-a4b --batch 1 --systems eager gemma4opt gemma4opt-finegrained-fp8 \
            static_compile --json "$OUT/generate.jsonl" ;;
    # The 31b case of the paged generate tests against eager (rope_cos_sin at head_dim 512 among them; 90 s with
    # FlashInfer's kernels carried in .ficache).
    paged-31b)
      MAX_JOBS=16 stage paged-31b 90 $PYTEST -s tests/gpu/test_gpu_paged.py -k "paged_generate_equals_eager and 31b" ;;
    # The small presets at batch 1 against both HF baselines on this checkout, one preset a stage (a call each,
    # carrying .ficache: ~250 s for the e2b, ~300 s for the e4b and the 26b-a4b on an H100; REFRESH_LIMIT
    # raises the limit for a fresh machine's first call, which JIT-compiles FlashInfer).
    fused-inputs)
      # The fp8 GEMMs that make their own input at decode (o_proj quantizing its input, the MLP's gate/up GEMV
      # with gelu·mul then the quantizing down) against their references on the GPU, then the e4b at batch 1
      # with fp8 weights + lm_head, those fusions on (their picks) and off, and in bf16, in one call.
      stage fused-inputs-tests 200 $PYTEST -s tests/gpu/test_gpu_fp8_fused_inputs.py
      stage fused-inputs-e4b 330 $GEN e4b --batch 1 --systems gemma4opt gemma4opt-fp8-head \
            gemma4opt-fp8-head-quant-kernels --json "$OUT/generate.jsonl" ;;
    moe-streams)
      # The MoE layers' experts branch on a side stream in the decode graphs: the GPU test (forks, and
      # scores bit-equal to one stream's), then the 26b-a4b at batch 1 and 8 with and without it, bf16.
      stage moe-streams-tests "${STREAMS_TEST_LIMIT:-220}" $PYTEST -s tests/gpu/test_gpu_moe_streams.py -k "${STREAMS_TEST_K:-}"
      stage moe-streams-26b "${STREAMS_LIMIT:-340}" $GEN 26b-a4b --batch ${STREAMS_BATCH:-1 8} --systems gemma4opt-moe-streams gemma4opt-no-moe-streams \
            --json "$OUT/generate.jsonl" ;;
    moe-streams-fp8)
      stage moe-streams-fp8-26b 400 $GEN 26b-a4b --batch 1 8 --systems gemma4opt-fp8-head-moe-streams \
            gemma4opt-fp8-head-no-moe-streams --json "$OUT/generate.jsonl" ;;
    refresh-e2b) stage refresh-e2b "${REFRESH_LIMIT:-300}" $GEN e2b --batch 1 --systems eager static_compile gemma4opt --json "$OUT/generate.jsonl" ;;
    refresh-e4b) stage refresh-e4b "${REFRESH_LIMIT:-400}" $GEN e4b --batch 1 --systems eager static_compile gemma4opt gemma4opt-fp8-head \
                   --json "$OUT/generate.jsonl" ;;
    refresh-26b) stage refresh-26b "${REFRESH_LIMIT:-450}" $GEN 26b-a4b --batch 1 --systems eager static_compile gemma4opt gemma4opt-fp8-head \
                   --json "$OUT/generate.jsonl" ;;
    pending-e4b)
      stage pending-e4b 560 $GEN e4b --batch 1 --systems eager gemma4opt-no-norm-linear gemma4opt gemma4opt-no-rope \
            gemma4opt-no-row-split gemma4opt-fp8-head-no-norm-linear gemma4opt-fp8-head gemma4opt-norm-linear-forced \
            gemma4opt-fp8-head-no-rope --json "$OUT/generate.jsonl" ;;
    rope-kernel-tests)
      stage rope-kernel-tests 90 $PYTEST tests/gpu/test_gpu_rope.py ;;
    quick-e4b)
      stage quick-e4b 330 $GEN e4b --batch 1 --systems eager gemma4opt gemma4opt-pipe gemma4opt-no-norm-linear \
            --json "$OUT/generate.jsonl" ;;
    # The pipelined row sums (PIPE): each one-row GEMM's pipelined loop against its plain loop, bit for bit, bf16,
    # fp8, the residual-tail GEMMs, the MoE decode kernels, the dense gate/up GEMV (110 s).
    pipe-tests)
      stage pipe-tests 110 $PYTEST tests/gpu/test_gpu_pipelined.py ;;
    # fp8 weights + lm_head on the e4b at batch 1: the defaults, the pipelined row sums offered, no norm_linear (520 s).
    fp8-e4b-pipe)
      stage fp8-e4b-pipe 520 $GEN e4b --batch 1 --systems eager gemma4opt-fp8-head gemma4opt-fp8-head-pipe \
            gemma4opt-fp8-head-no-norm-linear --json "$OUT/generate.jsonl" ;;
    # The MoE decode kernels' pipelined loops, kernel by kernel (bf16 and fp8 experts, 1 and 8 tokens; 150 s),
    # then the 26b-a4b at batch 1: eager, the defaults, the MoE loops pipelined, without the pipelined row sums (400 s).
    moe-pipe-sweep)
      stage moe-pipe-sweep 150 bash -c "python3 benchmarks/bench_kernels.py --sweep moe_pipe --presets 26b-a4b --m 1 8 \
            --json $OUT/moe_pipe.jsonl && python3 benchmarks/bench_kernels.py --sweep moe_fp8_pipe --presets 26b-a4b \
            --m 1 8 --json $OUT/moe_fp8_pipe.jsonl" ;;
    pipe-26b)
      stage pipe-26b 400 $GEN 26b-a4b --batch 1 --systems eager gemma4opt gemma4opt-moe-pipe gemma4opt-pipe \
            --json "$OUT/generate.jsonl" ;;
    # norm_linear: the tail inside the GEMM compiled against the two kernels at the presets' shapes, every tile
    # kind, the op's pick and a graph replay; the interpreter's kernel tests compiled (150 s).
    norm-linear-tests)
      stage norm-linear-tests 200 $PYTEST tests/gpu/test_gpu_norm_linear.py tests/kernels/test_norm_linear_kernel.py \
            tests/kernels/test_norm_fp8_linear_kernel.py ;;
    # rope_cos_sin: the kernel's bits against PyTorch's over every position of each preset's context (both forms
    # of HF's product), a graph replay with new positions, and the paged generate tests that compare tokens
    # with eager (150 s); the e4b at batch 1 without (-no-rope) and with it, bf16 and fp8 + lm_head (330 s).
    row-split-tests)
      stage row-split-tests 120 $PYTEST tests/gpu/test_gpu_linear.py tests/kernels/test_skinny_linear_kernel.py ;;
    rope-tests)
      stage rope-tests 150 $PYTEST tests/gpu/test_gpu_rope.py tests/gpu/test_gpu_paged.py -k "rope or \
            paged_generate_equals_eager or do_not_sync or bucket_graphs" ;;
    rope-e4b)
      stage rope-e4b 330 $GEN e4b --batch 1 --systems eager gemma4opt-no-rope gemma4opt gemma4opt-fp8-head-no-rope \
            gemma4opt-fp8-head --json "$OUT/generate.jsonl" ;;
    direct-e4b)
      stage direct-e4b 560 $GEN e4b --batch 1 --systems eager static_compile gemma4opt-nodirect gemma4opt \
            gemma4opt-fp8-head-nodirect gemma4opt-fp8-head --json "$OUT/generate.jsonl" ;;
    direct-26b)
      stage direct-26b 400 $GEN 26b-a4b --batch 1 --systems eager gemma4opt-fp8-head-nodirect gemma4opt-fp8-head \
            --json "$OUT/generate.jsonl" ;;
    host-stacks-e4b)
      stage host-stacks-e4b 480 /tmp/site/bin/py-spy record --idle --format raw -o "$OUT/host_e4b.folded" --rate 250 -- \
            python3 benchmarks/profile_host.py --preset e4b --layers 42 --quantization fp8 --quantize-lm-head --new 128
      stage host-stacks-e4b-top 30 python3 benchmarks/profile_host.py --stacks "$OUT/host_e4b.folded" --top 80 ;;
    profile-e4b-fp8)
      # The e4b at batch 1 with fp8 weights and lm_head, kernel by kernel in order, PDL off; then the same in bf16.
      GEMMA4OPT_PDL=0 stage profile-e4b-fp8 200 python3 benchmarks/profile_decode.py --preset e4b --new 16 \
            --attention paged --quantization fp8 --quantize-lm-head --per-category 30
      GEMMA4OPT_PDL=0 stage profile-e4b 170 python3 benchmarks/profile_decode.py --preset e4b --new 16 \
            --attention paged --per-category 30 ;;
    profile-presets)
      # The small presets' decode steps kernel by kernel (PDL off): e4b at batch 32, e2b at 1, 26b-a4b at 8.
      GEMMA4OPT_PDL=0 stage profile-e4b-32 190 python3 benchmarks/profile_decode.py --preset e4b --batch 32 --new 16 \
            --attention paged --per-category 30
      GEMMA4OPT_PDL=0 stage profile-e2b 130 python3 benchmarks/profile_decode.py --preset e2b --new 16 \
            --attention paged --per-category 30
      GEMMA4OPT_PDL=0 stage profile-26b-8 200 python3 benchmarks/profile_decode.py --preset 26b-a4b --batch 8 \
            --new 16 --attention paged --per-category 30 ;;
    fp8-moe-decode)
      # The fp8 experts at decode: every tile of the moe_fp8 sweep (and the grouped kernels) at 1-8 tokens of the
      # 26b-a4b, the bf16 and fp8 ops against Inductor, then the 26b-a4b's fp8 decode step kernel by kernel (PDL off).
      stage moe-fp8-sweep 200 python3 benchmarks/bench_kernels.py --sweep moe_fp8 --presets 26b-a4b --m 1 4 8 \
            --json "$OUT/sweep_moe_fp8.jsonl"
      stage moe-ops 90 python3 benchmarks/bench_kernels.py --only moe_experts --presets 26b-a4b --m 1 8 32 \
            --json "$OUT/kernels_moe.json"
      GEMMA4OPT_PDL=0 stage profile-26b-fp8 290 python3 benchmarks/profile_decode.py --preset 26b-a4b --new 16 \
            --attention paged --quantization fp8 --quantize-lm-head --per-category 30 ;;
    router-decode)
      # The one-launch decode router and the fp8 decode experts' tiles compiled against their references and HF's
      # router at the 26b-a4b's dimensions (also replayed in a CUDA graph); the router's launch sweep; the router and
      # experts ops (one launch against the three it replaced, fp8 against bf16 experts) against Inductor.
      stage router-tests 200 $PYTEST tests/kernels/test_moe_router_decode_kernel.py tests/kernels/test_moe_router_kernel.py \
            tests/kernels/test_moe_experts_kernel.py tests/gpu/test_gpu_moe_router.py tests/gpu/test_gpu_moe_experts.py
      stage router-sweep 80 python3 benchmarks/bench_kernels.py --sweep router --presets 26b-a4b --m 1 8 32 \
            --json "$OUT/sweep_router.jsonl"
      stage router-ops 100 python3 benchmarks/bench_kernels.py --only moe_ --presets 26b-a4b --m 1 8 32 \
            --json "$OUT/kernels_moe.json" ;;
    router-decode-26b)
      # The 26b-a4b at batch 1, bf16 and fp8 weights + lm_head, against HF static cache + compile and eager
      # (tokens compared), then the same two on .baseline's older checkout in the same call.
      stage router-26b 420 $GEN 26b-a4b --batch 1 --systems gemma4opt gemma4opt-fp8-head static_compile eager \
            --json "$OUT/generate.jsonl"
      if [ -d .baseline/gemma4opt ]; then
        (cd .baseline && ln -sfn ../patterns gemma4opt/patterns && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} &&
         stage router-26b-before 150 $GEN 26b-a4b --batch 1 --systems gemma4opt gemma4opt-fp8-head \
               --json "$OUT/generate_before.jsonl")
      fi ;;
    host)
      # The host's time per decode step (profile_host.py): 2-layer models, whose device step is a small
      # fraction of it, e2b in bf16 (and at full depth) and the 26b-a4b with fp8 weights and lm_head.
      stage host-e2b 240 python3 benchmarks/profile_host.py --preset e2b --layers 2 --full \
            --json "$OUT/host.jsonl"
      stage host-26b-fp8 200 python3 benchmarks/profile_host.py --preset 26b-a4b --layers 2 --quantization fp8 \
            --quantize-lm-head --json "$OUT/host.jsonl" ;;
    features)
      MAX_JOBS=16 stage features-tests 300 $PYTEST -s tests/gpu/test_gpu_features.py
      stage features-assisted 420 python3 benchmarks/bench_assisted.py --preset 31b --layers 12 --assistant e2b --profile \
            --json "$OUT/assisted.jsonl"
      stage features-accepted 300 python3 benchmarks/bench_assisted.py --preset 31b --layers 12 --assistant e2b \
            --draft 7 --accept-all --json "$OUT/assisted.jsonl" ;;
    *) echo "unknown suite $s (tests, tests-oneliner, tests-kernels, tests-gpu, tests-paged, tests-paged-generate, fp8, speed-fp8, features, speed, speed-batches, presets-ab-26b, presets-ab-e4b, presets-ab-e2b, moe-e2b-ab, verify-moe, probe, final-presets, speed-presets, speed-31b-full, tp, kernels, attention, profile, profile-layers, fp8-check, fp8-attention-26b, fp8-verify, fp8-26b-eager, e4b-static, gelu-linear, gelu-linear-ab, whole-k-ab, speed-31b-full-fp8, profile-presets, narrow-ab-e4b, narrow-ab-26b, presets-rest, moe-grouped, moe-grouped-kernels, presets-26b-32, moe-grouped-fp8, fp8-moe-decode, router-decode, router-decode-26b, host, profile-e4b-fp8, rows, host-stacks, fp8-quality-paired, step-share, host-full, host-stacks-e4b, direct-decode, direct-e4b, direct-26b, layer-table, layer-table-e4b, layer-table-small, fp8-probe, probe-tables, freed, hf-fp8-e4b, fused-inputs, moe-streams, moe-streams-fp8)" ;;
  esac
done
