"""HF eager vs HF static cache + torch.compile vs gemma4opt, in HF generate, same model, one process.

    python benchmarks/bench_generate.py --preset 31b --layers 12 --batch 1 --prompt 128 --new 64
    python benchmarks/bench_generate.py --preset tiny --device cpu        # runs on a CPU too
    python benchmarks/bench_generate.py --systems gemma4opt eager static_compile   # any order

Prints per system: time to first token, ms per decode step (tokens after the first), tokens/s,
and the fraction of the HBM roofline (weight + KV bytes per step / measured copy bandwidth).
Greedy tokens of every system are compared with HF eager's.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4opt  # noqa: E402
from gemma4opt.kernels import moe_experts  # noqa: E402
from gemma4opt.kernels._util import PDL_DEFAULT, set_decode_row_warps, set_pdl  # noqa: E402
from gemma4opt.kernels.skinny_linear import use_tiles  # noqa: E402
from gemma4opt.ops.state import MARGINS  # noqa: E402
from gemma4opt.patterns import DEFAULT_PATTERNS, PATTERN_NAMES  # noqa: E402
from gemma4opt.presets import ALL_PRESETS, build_model, finegrained_fp8_  # noqa: E402
from roofline import copy_bandwidth, kv_bytes_per_step, weight_bytes_per_step  # noqa: E402

_WITHOUT_STREAMS = tuple(p for p in PATTERN_NAMES if p != "moe_streams")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _gen(model, ids, new, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, **kw)


def eager_margins(model, out, new, rows_per_pass=4) -> torch.Tensor:
    """[B, new] fp32: at each generated step, eager's top-1 logit minus its second, teacher-forced on
    eager's own tokens (a few rows per forward: the logits of a 262k vocabulary are large). Where
    another system's tokens first differ, a margin of a bf16 rounding or two says a near-tie flipped."""
    margins = []
    with torch.no_grad():
        for rows in out.split(rows_per_pass):
            logits = model(rows[:, :-1], logits_to_keep=new).logits.float()
            top2 = logits.topk(2, dim=-1).values
            margins.append((top2[..., 0] - top2[..., 1]).cpu())
    return torch.cat(margins)


def first_divergence(out, eager_out, margins, new) -> tuple[int, float] | None:
    """(first generated step where ``out`` differs from eager's in any row, eager's top-2 margin there)."""
    gen, ref = out[:, -new:].cpu(), eager_out[:, -new:].cpu()
    diff = gen != ref
    if not diff.any():
        return None
    steps = torch.where(diff.any(1), diff.float().argmax(1), torch.full((diff.shape[0],), new))
    row = int(steps.argmin())
    return int(steps[row]), float(margins[row, steps[row]])


class _CollectorTime:
    """ms Python's garbage collector spent, and its collections by generation, from its making to
    its close."""

    def __init__(self):
        self.ms, self.by_gen, self._t0 = 0.0, [0, 0, 0], None
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.by_gen[info["generation"]] += 1

    def close(self):
        gc.callbacks.remove(self)


def measure(model, ids, new, device, repeats, runs: list | None = None, collector: list | None = None, **kw):
    """(ttft_ms, ms per decode step, output ids, warm-up s); best of ``repeats`` after a warm-up.
    ``runs``, where given, gets every repeat's ms per decode step (the spread the best hides);
    ``collector`` the garbage collector's (ms, collections per generation) in each timed generate."""
    _sync(device)
    t_warm = time.perf_counter()
    _gen(model, ids, new, **kw)           # warm-up: compiles, captures graphs
    _sync(device)
    t_warm = time.perf_counter() - t_warm
    ttft, total, out = [], [], None
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        _gen(model, ids, 1, **kw)
        _sync(device)
        t1 = time.perf_counter()
        gc_time = _CollectorTime()
        try:
            out = _gen(model, ids, new, **kw)
            _sync(device)
        finally:
            gc_time.close()
        t2 = time.perf_counter()
        if collector is not None:
            collector.append((round(gc_time.ms, 3), gc_time.by_gen))
        ttft.append((t1 - t0) * 1e3)
        total.append((t2 - t1) * 1e3)
    t_first, t_all = min(ttft), min(total)
    if runs is not None:
        runs.extend((t - t_first) / max(new - 1, 1) for t in total)
    return t_first, (t_all - t_first) / max(new - 1, 1), out, t_warm


def graph_replay_ms(state, n=100) -> tuple[float, float] | None:
    """(device ms, host ms) of one decode step alone: the CUDA graph generate replayed last,
    replayed ``n`` times back to back with nothing on the host between; the device's time per
    replay, and the host's per launch (cudaGraphLaunch's own cost, which grows with the graph's
    nodes; were it above the device's, the first would measure it instead). Against generate's ms
    per step they split a step into the device's time and what the device waits for on the host.
    Replaying the last step again rewrites the same KV slot with the same values."""
    graph = getattr(state, "last_replayed", None)
    if graph is None:
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    host = (time.perf_counter() - t0) * 1e3 / n
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n, host


# gemma4opt variants. "gemma4opt" is the one-liner, optimize(model) with every default (on CUDA the
# paged mode with sizes taken from the model and the free memory); "gemma4opt-paged" is the paged
# mode sized for exactly this run (max_batch_size, max_seq_len); "gemma4opt-hf" HF attention + cache.
GEMMA4OPT_SYSTEMS = {"gemma4opt": {}, "gemma4opt-hf": dict(attention="hf"), "gemma4opt-inductor": dict(inductor=True),
                     "gemma4opt-captured": dict(inductor=False), "gemma4opt-paged": dict(attention="paged"),
                     # The paged cache with FlashInfer's planned decode instead of the Triton kernel.
                     "gemma4opt-paged-fi": dict(attention="paged", decode_kernel="flashinfer"),
                     "gemma4opt-paged-auto": dict(attention="paged", decode_kernel="auto"),
                     # Every decode GEMM on cuBLAS (no decode_linear, no gate_up_gelu): the Triton GEMMs' share.
                     "gemma4opt-paged-cublas": dict(attention="paged", patterns=tuple(
                         p for p in DEFAULT_PATTERNS if p not in ("decode_linear", "gate_up_gelu"))),
                     # Every decode GEMM on the skinny Triton GEMM, whatever the per-shape timing picked
                     # (the margin it must beat cuBLAS by made unbeatable): is the isolated timing's pick
                     # the faster one inside the decode graph?
                     "gemma4opt-triton-gemms": dict(margins={"linear": 1e9, "linear_softcap": 1e9}),
                     # Every gelu·mul its own launch (no gelu_linear): that fusion's share.
                     "gemma4opt-no-gelu-linear": dict(patterns=tuple(p for p in DEFAULT_PATTERNS if p != "gelu_linear")),
                     # HF's rotary cos/sin ops in place of the one-launch rope_cos_sin (its A/B).
                     "gemma4opt-no-rope": dict(patterns=tuple(p for p in DEFAULT_PATTERNS if p != "rope_cos_sin")),
                     "gemma4opt-fp8-head-no-rope": dict(quantization="fp8", quantize_lm_head=True, patterns=tuple(
                         p for p in DEFAULT_PATTERNS if p != "rope_cos_sin")),
                     # Each residual tail its own launch before the q/k/v and per-layer-input gate GEMMs (no
                     # norm_linear), and the tail inside those GEMMs whatever each shape's timing picked.
                     "gemma4opt-no-norm-linear": dict(patterns=tuple(p for p in DEFAULT_PATTERNS if p != "norm_linear")),
                     "gemma4opt-norm-linear-forced": dict(margins={"norm_linear": 1e9}),
                     "gemma4opt-fp8-head-no-norm-linear": dict(quantization="fp8", quantize_lm_head=True, patterns=tuple(
                         p for p in DEFAULT_PATTERNS if p != "norm_linear")),
                     # The skinny GEMM at one row without its whole-K tiles: their share.
                     "gemma4opt-no-whole-k": dict(whole_k=False),
                     # ... and without its split-K tiles at one row (narrow N, long K: the MLP down).
                     "gemma4opt-no-row-split": dict(row_split=False),
                     # The MoE layers' experts branch beside the dense MLP on a side stream (every pattern
                     # named), or the two one after the other on one stream (every pattern but that one).
                     "gemma4opt-moe-streams": dict(patterns=PATTERN_NAMES),
                     "gemma4opt-no-moe-streams": dict(patterns=_WITHOUT_STREAMS),
                     "gemma4opt-fp8-head-moe-streams": dict(quantization="fp8", quantize_lm_head=True, patterns=PATTERN_NAMES),
                     "gemma4opt-fp8-head-no-moe-streams": dict(quantization="fp8", quantize_lm_head=True,
                                                               patterns=_WITHOUT_STREAMS),
                     # ... and at 2-32 rows without its narrow tiles (16-32 W rows, K split up to 16 ways).
                     "gemma4opt-no-narrow": dict(narrow=False),
                     # The one-row GEMMs (bf16, fp8, with the residual tail) offered their pipelined row sums
                     # (off by default; on by default at commit ab14225, where "-no-pipe" took them away).
                     "gemma4opt-pipe": dict(pipelined=True),
                     "gemma4opt-fp8-head-pipe": dict(quantization="fp8", quantize_lm_head=True, pipelined=True),
                     # The MoE decode kernels' (and the dense gate/up GEMV's) K loops pipelined 3 stages deep.
                     "gemma4opt-moe-pipe": dict(moe_pipe=3),
                     "gemma4opt-fp8-head-moe-pipe": dict(quantization="fp8", quantize_lm_head=True, moe_pipe=3),
                     # Every gemma4opt kernel launched plainly: programmatic dependent launch's share.
                     "gemma4opt-paged-nopdl": dict(attention="paged", pdl=False),
                     "gemma4opt-fp8-head-nopdl": dict(quantization="fp8", quantize_lm_head=True, pdl=False),
                     # FP8 (e4m3) weights of the attention and dense-MLP projections; "-kv8": and the KV pool.
                     "gemma4opt-fp8": dict(quantization="fp8"),
                     # A FineGrainedFP8 checkpoint (--fp8-block; the lm_head kept in bf16) run by gemma4opt
                     "gemma4opt-finegrained-fp8": dict(checkpoint="finegrained-fp8"),
                     "gemma4opt-fp8-kv8": dict(quantization="fp8", kv_cache_dtype="fp8"),
                     # And the lm_head in fp8 (an fp8 copy beside the tied bf16 embedding table).
                     "gemma4opt-fp8-head": dict(quantization="fp8", quantize_lm_head=True),
                     # Each fp8 GEMM input that no producer quantizes (o_proj's, the MLP's down after the gate/up
                     # GEMM) quantized by kernels of its own, whatever the picks timed ("-quant-kernels"), or
                     # inside the GEMM always ("-fused-inputs"): the share of quant_fp8_linear and the fp8 MLP op.
                     "gemma4opt-fp8-head-quant-kernels": dict(quantization="fp8", quantize_lm_head=True, margins={
                         "quant_fp8_linear": 0.0, "fp8_mlp": 0.0}),
                     "gemma4opt-fp8-head-fused-inputs": dict(quantization="fp8", quantize_lm_head=True, margins={
                         "quant_fp8_linear": 1e9, "fp8_mlp": 1e9}),
                     # Every decode step through Dynamo's entry (direct_decode off): what skipping it saves.
                     "gemma4opt-nodirect": dict(direct_decode=False),
                     "gemma4opt-fp8-head-nodirect": dict(quantization="fp8", quantize_lm_head=True, direct_decode=False),
                     # Every row kernel (norms, their fused quantization, norm_add) at decode on N warps a
                     # program, instead of row_launch's rule (up to one per 256 columns).
                     **{f"gemma4opt-rows{w}": dict(row_warps=w) for w in (2, 4, 8)},
                     **{f"gemma4opt-fp8-head-rows{w}": dict(quantization="fp8", quantize_lm_head=True, row_warps=w)
                        for w in (2, 4, 8)},
                     "gemma4opt-fp8-kv8-head": dict(quantization="fp8", kv_cache_dtype="fp8", quantize_lm_head=True),
                     "gemma4opt-paged-fp8": dict(attention="paged", quantization="fp8"),
                     "gemma4opt-paged-fp8-kv8": dict(attention="paged", quantization="fp8", kv_cache_dtype="fp8")}


# transformers' own FP8 path: the model as FineGrainedFP8Config loads it (presets.finegrained_fp8_, the lm_head
# kept in bf16), its FP8Linear forward on the finegrained-fp8 Triton kernel (hf_fp8_kernel.py), run by HF
# generate in eager or with HF static cache + torch.compile (as static_compile).
HF_FP8_SYSTEMS = ("hf-fp8", "hf-fp8-static")
STATIC_SYSTEMS = ("static_compile", "hf-fp8-static")


HEADER = (f"{'batch':>5} {'system':>18} {'warm-up s':>9} {'TTFT ms':>9} {'ms/step':>9} {'tok/s':>9} "
          f"{'roofline':>9} {'vs eager':>9} {'vs static':>9} tokens==eager")


def _line(row, res) -> str:
    """One result row; ratios against the systems of ``res`` (this batch) measured so far."""
    ms = row["ms_per_step"]
    vs_e = res["eager"]["ms_per_step"] / ms if "eager" in res else float("nan")
    vs_s = res["static_compile"]["ms_per_step"] / ms if "static_compile" in res else float("nan")
    kv = f"; KV {row['kv_mib_per_seq']:.1f} MiB/seq" if "kv_mib_per_seq" in row else ""
    if "graph_replay_ms" in row:        # the device's time per step alone, the rest the host's
        kv += f"; graph replay {row['graph_replay_ms']:.2f} ms, its launch {row['graph_launch_ms']:.3f} ms on the host"
    if len(row.get("ms_per_step_runs", ())) > 1:
        kv += f"; runs {'/'.join(f'{t:.2f}' for t in row['ms_per_step_runs'])}"
    if any(ms for ms, _ in row.get("gc_runs", ())):     # the garbage collector inside the timed generates
        kv += "; gc " + "/".join(f"{ms:.0f} ms {n}" for ms, n in row["gc_runs"])
    return (f"{row['batch']:>5} {row['system']:>18} {row['warmup_s']:>9.1f} {row['ttft_ms']:>9.1f} {ms:>9.2f} "
            f"{row['tok_s']:>9.1f} {row['roofline_frac']:>8.0%} {vs_e:>8.2f}x {vs_s:>8.2f}x "
            f"{row['tokens_equal_eager']}   (roofline {row['roofline_ms']:.2f} ms{kv})")


def _roofline_ms(model, args, kv_elem=None) -> dict:
    """Per batch: the ms one decode step's weight and KV bytes take at the measured copy bandwidth."""
    return {b: (weight_bytes_per_step(model, b) + kv_bytes_per_step(model, b, args.prompt + args.new // 2, kv_elem))
            / args.bandwidth * 1e3 for b in args.batch}


def _run_system(args, model, i, system, prompts, roof, rows, results, cfg) -> bool:
    """Measures one system; True where it optimized ``model`` itself and later systems need it rebuilt."""
    gc.collect()            # what the previous system held (and PyTorch cached) goes back to CUDA
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    kw, sys_model = {}, model
    last = i == len(args.systems) - 1
    if system in STATIC_SYSTEMS:
        from transformers import CompileConfig

        cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
        cc._compile_all_devices = True      # HF auto-compiles on CUDA only; benchmark CPU runs too
        kw = dict(cache_implementation="static", compile_config=cc)
    if system in GEMMA4OPT_SYSTEMS or system in HF_FP8_SYSTEMS:
        # optimize() (or the fp8 swap) changes the instance: when other systems still follow, change a copy,
        # or, where two copies do not fit the GPU (the 26b-a4b on an H100), the model itself, rebuilt after.
        sys_model = model if last or args.rebuild else copy.deepcopy(model)
    if system in HF_FP8_SYSTEMS:
        import hf_fp8_kernel

        hf_fp8_kernel.load(args.hf_fp8_kernel)
        finegrained_fp8_(sys_model, (args.fp8_block, args.fp8_block), skip=("lm_head",))
        roof = _roofline_ms(sys_model, args)
    if system in GEMMA4OPT_SYSTEMS:
        opts = dict(GEMMA4OPT_SYSTEMS[system])
        set_pdl(opts.pop("pdl", PDL_DEFAULT))      # read at each launch: off for this system's whole run
        use_tiles(opts.pop("whole_k", True), opts.pop("narrow", True),      # read when a GEMM shape is first tuned
                  opts.pop("row_split", True), opts.pop("pipelined", False))
        set_decode_row_warps(opts.pop("row_warps", None))   # read at each launch, captured with the graphs
        moe_pipe = opts.pop("moe_pipe", 0)                  # read at each launch, captured with the graphs
        for tiles in (moe_experts.TILES, moe_experts.TILES_FP8):
            tiles.update(gu_pipe=moe_pipe, dn_pipe=moe_pipe)
        if opts.pop("checkpoint", None):
            finegrained_fp8_(sys_model, (args.fp8_block, args.fp8_block), skip=("lm_head",))
        margins = dict(MARGINS)
        MARGINS.update(opts.pop("margins", {}))     # read when optimize() makes the model's op state
        if opts.get("attention") == "paged":     # tuned: a pool for exactly this run's batches and lengths
            opts.update(max_batch_size=max(args.batch), max_seq_len=args.prompt + args.new + 16)
        try:
            gemma4opt.optimize(sys_model, gemma4opt.Gemma4OptConfig(**opts))
        finally:
            MARGINS.update(margins)
        if opts.get("quantization") or opts.get("kv_cache_dtype") or system == "gemma4opt-finegrained-fp8":
            # fewer bytes: its own roofline
            roof = _roofline_ms(sys_model, args, 1 if opts.get("kv_cache_dtype") == "fp8" else None)
    for b in args.batch:
        runs, collector = [], []
        ttft, ms, out, warm = measure(sys_model, prompts[b], args.new, args.device, args.repeats, runs, collector,
                                      **kw)
        res = results[b]
        res[system] = dict(ms_per_step=ms, out=out)
        if system == "eager":
            res[system]["margins"] = eager_margins(sys_model, out, args.new)
        same = torch.equal(out, res["eager"]["out"]) if "eager" in res else None
        row = dict(run=args.run, machine=args.machine, command=args.command,
                   preset=args.preset, layers=cfg.num_hidden_layers, batch=b, prompt=args.prompt, new=args.new,
                   system=system, warmup_s=warm, ttft_ms=ttft, ms_per_step=ms, tok_s=b * 1e3 / ms, roofline_ms=roof[b],
                   roofline_frac=roof[b] / ms, tokens_equal_eager=same)
        row["ms_per_step_runs"], row["gc_runs"] = runs, collector
        state = getattr(sys_model, "_gemma4opt", None)
        if state is not None:
            row["mode"] = state.mode_reason
            replay = graph_replay_ms(state)
            if replay is not None:
                row["graph_replay_ms"], row["graph_launch_ms"] = replay
        ctx = getattr(state, "context", None)
        if ctx is not None and ctx.last_kv_held[1]:       # paged: KV a sequence held at the end of generate
            row["kv_mib_per_seq"] = ctx.last_kv_held[0] / ctx.last_kv_held[1] / 2**20
        print(_line(row, res), flush=True)
        rows.append(row)
    if system in GEMMA4OPT_SYSTEMS:
        gemma4opt.report(sys_model)
        set_pdl(PDL_DEFAULT)
        set_decode_row_warps(None)
    if sys_model is not model or system in STATIC_SYSTEMS:
        # Its copy of the weights, its KV pool or static cache and its CUDA graphs stay reachable
        # from Dynamo's caches until reset (at batch 128 x prompt 2048 the next system's prefill ran
        # out of memory otherwise); the next system's start collects and empties the cache.
        torch._dynamo.reset()
    return (system in GEMMA4OPT_SYSTEMS or system in HF_FP8_SYSTEMS) and sys_model is model and not last


def _allocated_gib(device: str) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.startswith("cuda") else 0.0


def _compare_with_eager(rows, results) -> None:
    """Systems measured before eager were not compared when they ran: compare them now. Where the
    tokens differ: the first step that differs and eager's top-2 logit margin there."""
    for b, res in results.items():
        if "eager" in res:
            same = {s: torch.equal(r["out"], res["eager"]["out"]) for s, r in res.items() if s != "eager"}
            print(f"# batch {b}: greedy tokens equal HF eager: {same}")
            for row in rows:
                if row["batch"] == b and row["system"] in same:
                    row["tokens_equal_eager"] = same[row["system"]]
                    where = first_divergence(res[row["system"]]["out"], res["eager"]["out"], res["eager"]["margins"],
                                             row["new"])
                    if where is not None:
                        row["first_diff_step"], row["eager_margin_at_diff"] = where
                        print(f"#   {row['system']}: first differs at generated step {where[0]}, where eager's "
                              f"top-2 logit margin was {where[1]:.4g}")


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The model and workload arguments the generate benchmarks share."""
    ap.add_argument("--preset", default="tiny", choices=sorted(ALL_PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rebuild", action=argparse.BooleanOptionalAction, default=None,
                    help="optimize the model itself and rebuild it (same seed) for the systems after, instead of "
                         "optimizing a copy (default: where two copies of the weights would not fit the GPU)")
    ap.add_argument("--systems", nargs="+", default=["eager", "static_compile", "gemma4opt"],
                    choices=["eager", "static_compile", *HF_FP8_SYSTEMS, *GEMMA4OPT_SYSTEMS])
    ap.add_argument("--fp8-block", type=int, default=128,
                    help="gemma4opt-finegrained-fp8's and hf-fp8's weight_block_size (128; smaller for tiny presets)")
    ap.add_argument("--hf-fp8-kernel", default=None,
                    help="hf-fp8 / hf-fp8-static: the finegrained-fp8 kernel package (default .hfkernels/finegrained_fp8; "
                         "see benchmarks/hf_fp8_kernel.py)")
    ap.add_argument("--json", default=None, help="append result rows to this JSON-lines file")
    ap.add_argument("--run", default=None, help="run id stamped on every row (default: date/time, preset, layers)")
    args = ap.parse_args(argv)
    # A stage's `timeout` sends SIGTERM: exit through the finally below, so the rows measured so far
    # still reach --json.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]

    model = build_model(args.preset, args.layers, dtype=dtype, device=args.device)
    cfg = model.config.get_text_config()
    nparams = sum(p.numel() for p in model.parameters())
    if args.rebuild is None:    # a copy of the weights beside them must leave a fifth of the GPU's memory
        args.rebuild = args.device.startswith("cuda") and 2 * nparams * dtype.itemsize > 0.8 * \
            torch.cuda.get_device_properties(args.device).total_memory
    bw = args.bandwidth = copy_bandwidth(args.device)
    print(f"# preset {args.preset} layers {cfg.num_hidden_layers} params {nparams / 1e9:.2f} B {dtype} on "
          f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s; prompt {args.prompt}, new {args.new}")
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(3, cfg.vocab_size, (b, args.prompt), generator=g).to(args.device) for b in args.batch}
    roof = _roofline_ms(model, args)
    args.run = args.run or time.strftime("%Y-%m-%d %H:%M/") + f"{args.preset}_l{cfg.num_hidden_layers}"
    args.machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    args.command = "python3 benchmarks/bench_generate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(HEADER, flush=True)
    rows, results = [], {b: {} for b in args.batch}
    # A time limit's SIGTERM as SystemExit: the finally below still writes the rows measured so far.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for i, system in enumerate(args.systems):
            if _run_system(args, model, i, system, prompts, roof, rows, results, cfg):
                held = _allocated_gib(args.device)
                del model           # the same seed builds the same weights again, with nothing else held
                gc.collect()
                torch.cuda.empty_cache()
                print(f"# {system} optimized the model itself: {held:.1f} GiB allocated, "
                      f"{_allocated_gib(args.device):.1f} GiB once it was dropped; rebuilt", flush=True)
                torch._dynamo.reset()   # whatever Dynamo still holds (the line above says if anything was)
                gc.collect()
                torch.cuda.empty_cache()
                model = build_model(args.preset, args.layers, dtype=dtype, device=args.device)
    finally:    # a system that fails (out of memory, say) keeps the rows measured before it
        _compare_with_eager(rows, results)
        if args.json:
            with open(args.json, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
    if len(args.systems) > 1:       # every ratio, now that every system ran
        print("# summary: every system against the others of this run")
        print(HEADER)
        for b in args.batch:
            for row in rows:
                if row["batch"] == b:
                    print(_line(row, results[b]))
            hf8 = results[b].get("hf-fp8-static")
            if hf8 is not None:      # the bar for fp8: transformers' own FP8 path, static cache + compile
                print(f"# batch {b}, against HF's own FP8 path with static cache + torch.compile ("
                      f"{hf8['ms_per_step']:.2f} ms/step): " + ", ".join(
                          f"{s} {hf8['ms_per_step'] / r['ms_per_step']:.2f}x" for s, r in results[b].items()
                          if s != "hf-fp8-static"))
    return rows


if __name__ == "__main__":
    main()
