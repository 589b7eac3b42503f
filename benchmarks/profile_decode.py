"""Where a gemma4opt decode step spends its time: torch.profiler over one generate, top kernels.

    python benchmarks/profile_decode.py --preset 31b --layers 12 --inductor 0

The per-category table is per decode step: a second profile of a one-token generate (the prefill
and HF's set-up) is subtracted kernel by kernel, so at batch 32 the prompt's 4096-token GEMMs do not
land in the decode step's figures.
"""
from __future__ import annotations

import argparse
import time

import torch

import gemma4opt
from gemma4opt.presets import ALL_PRESETS, build_model, finegrained_fp8_
from layer_timeline import Kernel, layer_stats, report, split_layers
from roofline import copy_bandwidth, kv_bytes_per_layer, weight_bytes_per_layer


# Kernel name fragments per category: what a decode step's device time goes to.
CATEGORIES = [("gemm", ("nvjet", "gemm", "splitKreduce", "cutlass_80_tensorop", "sm90_xmma", "_skinny_kernel",
                      "_fp8_linear", "_fp8_block_linear", "_norm_linear", "_norm_fp8_linear", "_gate_up_gelu_kernel",
                      "_split_sum")),
              ("attention", ("sdpa", "fmha", "flash", "BatchDecode", "BatchPrefill", "Attention",
                             "_decode_split_kernel", "_merge_kernel")),
              ("moe experts", ("_gate_up_kernel", "_down_kernel", "_grouped_gate_up", "_grouped_down",
                               "_combine_kernel")),
              ("gemma4opt triton", ("_rms_norm", "_add_rms_norm", "_gelu_tanh_mul", "_softcap", "_router",
                                    "_qkv_norm_rope_append", "_kv_append", "_norm_add", "_rope_cos_sin",
                                    "_quantize_rows", "_split_amax", "_split_quant", "_widen")),
              ("copies/index", ("copy", "index", "Fill", "cat")),
              ("other", ("",))]


def device_kernels(avgs) -> dict[str, list]:
    """{kernel name: [device self time us, launches]}, kernels only (host ops and compiled regions
    would count their kernels twice)."""
    out = {}
    for e in avgs:
        dev = getattr(e, "self_device_time_total", 0)
        if dev <= 0 or e.cpu_time_total > 0 or e.key.startswith("Torch-Compiled"):
            continue
        got = out.setdefault(e.key, [0.0, 0])
        got[0] += dev
        got[1] += e.count
    return out


def subtract(full: dict, part: dict) -> dict:
    """``full`` minus ``part`` per kernel, dropping what is left with no launch."""
    out = {}
    for key, (dev, n) in full.items():
        pd, pn = part.get(key, (0.0, 0))
        if n - pn > 0:
            out[key] = [max(dev - pd, 0.0), n - pn]
    return out


def print_categories(kernels: dict, steps: int, what: str, top=8):
    """Device time per category and kernel launches per ``what``; then, outside the GEMMs, each
    category's biggest kernels (what a fusion or a launch saved would go after)."""
    totals = {name: [0.0, 0] for name, _ in CATEGORIES}
    rows = {name: [] for name, _ in CATEGORIES}
    for key, (dev, n) in kernels.items():
        name = category(key)
        totals[name][0] += dev
        totals[name][1] += n
        rows[name].append((dev, n, key))
    print(f"device time per {what} by kernel category (us; launches):")
    for name, (dev, n) in totals.items():
        print(f"  {name:>18} {dev / steps:9.1f} us  {n / steps:7.1f} launches")
    for name, found in rows.items():
        print(f"  {name}: top kernels (us per {what}, launches per {what}, us per launch)")
        for dev, n, key in sorted(found, reverse=True)[:top]:
            print(f"    {dev / steps:8.1f} {n / steps:6.1f} {dev / max(n, 1):7.2f}  {key[:90]}")


def idle_gaps(prof, launches_per_step: float, steps: int, top=12):
    """Device idle time per decode step over the profile's last ``steps`` steps: the span of their
    kernels minus the union of the kernels' intervals, by gap size, and the kernel pairs with the
    most idle time between them (a host that falls behind shows as large gaps before a step's first
    kernel; launch latency inside a graph as many ~1 us gaps). Returns the last step's kernels
    (layer_timeline.Kernel, in launch order)."""
    from torch.autograd import DeviceType

    ks = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    ks = ks[-int(launches_per_step * steps):]
    if len(ks) < 2:
        return []
    span = ks[-1].time_range.end - ks[0].time_range.start
    buckets = {"<1us": 0.0, "1-3us": 0.0, "3-10us": 0.0, ">10us": 0.0}
    pairs, end = {}, ks[0].time_range.end
    for prev, k in zip(ks, ks[1:]):
        gap = k.time_range.start - end
        end = max(end, k.time_range.end)
        if gap <= 0:
            continue
        buckets["<1us" if gap < 1 else "1-3us" if gap < 3 else "3-10us" if gap < 10 else ">10us"] += gap
        key = (prev.name[:40], k.name[:40])
        got = pairs.setdefault(key, [0.0, 0])
        got[0] += gap
        got[1] += 1
    idle = sum(buckets.values())
    print(f"device timeline over the last {steps} decode steps: {span / steps:.1f} us per step, "
          f"idle {idle / steps:.1f} us per step ({idle / span:.1%}); idle by gap size per step: "
          + ", ".join(f"{k} {v / steps:.1f}" for k, v in buckets.items()))
    print("  most idle between (us per step, gaps per step): previous kernel -> next kernel")
    for (a, b), (gap, n) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {gap / steps:7.1f} {n / steps:5.1f}  {a} -> {b}")
    last = ks[-int(launches_per_step):]
    print(f"the last decode step in order ({len(last)} kernels): gap before (us), duration (us), kernel")
    end = last[0].time_range.start
    for k in last:
        print(f"  {k.time_range.start - end:6.1f} {k.time_range.end - k.time_range.start:7.1f}  {k.name[:100]}")
        end = max(end, k.time_range.end)
    return [Kernel(k.name, k.time_range.start, k.time_range.end) for k in last]


def category(name: str) -> str:
    return next(c for c, frags in CATEGORIES if any(f in name for f in frags))


def print_layers(kernels: list, model, batch: int, context: int, device: str = "cuda") -> None:
    """The last step's kernels by decoder layer (benchmarks/layer_timeline.py), with each layer's bytes
    (its weights and the KV it reads at ``context`` tokens) against the measured copy bandwidth."""
    try:
        prologue, layers, head = split_layers(kernels, lambda n: category(n) == "attention",
                                              lambda n: category(n) == "gemm")
    except ValueError as e:
        print(f"per-layer timeline: {e}")
        return
    weights = weight_bytes_per_layer(model, batch)
    kv = kv_bytes_per_layer(model, batch, context)
    nbytes = {i: weights.get(i, 0) + kv[i] for i in range(len(kv))} if len(layers) == len(kv) else None
    if nbytes is None:
        print(f"per-layer timeline: {len(layers)} layers found, the model has {len(kv)}: bytes left out")
    for line in report(layer_stats(layers, head, nbytes), prologue, head, copy_bandwidth(device)):
        print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(ALL_PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--inductor", type=int, default=None, choices=[0, 1])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--per-category", type=int, default=8, help="kernels listed per category")
    ap.add_argument("--attention", default="hf", choices=["hf", "paged"])
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--fp8-block", type=int, default=None,
                    help="profile a FineGrainedFP8 checkpoint in N x N blocks (transformers' own quantizer; lm_head bf16)")
    args = ap.parse_args(argv)
    model = build_model(args.preset, args.layers, dtype=torch.bfloat16, device="cuda")
    if args.fp8_block:
        finegrained_fp8_(model, (args.fp8_block, args.fp8_block), skip=("lm_head",))
    opts = dict(inductor=None if args.inductor is None else bool(args.inductor), attention=args.attention,
                quantization=args.quantization, quantize_lm_head=args.quantize_lm_head)
    if args.attention == "paged":       # a pool for exactly this run
        opts.update(max_batch_size=args.batch, max_seq_len=args.prompt + args.new + 16)
    cfg = gemma4opt.Gemma4OptConfig(**opts)
    gemma4opt.optimize(model, cfg)
    ids = torch.randint(3, 1000, (args.batch, args.prompt), device="cuda")

    def gen(new=args.new):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False)

    t = time.perf_counter()
    gen()
    torch.cuda.synchronize()
    print(f"warm-up (compile) {time.perf_counter() - t:.1f} s", flush=True)
    gen()
    torch.cuda.synchronize()
    t = time.perf_counter()
    gen()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
        gen()
        torch.cuda.synchronize()
    st = model._gemma4opt
    print(f"decode graphs: warm-ups {st.graph_warmups}, captures {st.graph_captures}, replays {st.graphed_calls}, "
          f"graphs compiled {st.graphs_compiled}, compiled calls {st.compiled_calls}")
    avgs = prof.key_averages()
    # Device time summed over ops with no device-side children double counted: self time only.
    dev_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in avgs)
    print(f"one generate: wall {wall_ms:.1f} ms = {wall_ms / args.new:.2f} ms per token (incl. prefill); "
          f"device busy {dev_us / 1e3:.1f} ms = {dev_us / 1e3 / args.new:.2f} ms per token under the profiler")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prefill:
        gen(1)
        torch.cuda.synchronize()
    steps = max(args.new - 1, 1)
    per_step = subtract(device_kernels(avgs), device_kernels(prefill.key_averages()))
    print_categories(per_step, steps, "decode step", top=args.per_category)
    last = idle_gaps(prof, sum(n for _, n in per_step.values()) / steps, steps // 2)
    print_layers(last, model, args.batch, args.prompt + args.new - 1)
    print("small host-launched ops by input shape (calls, device us in all): which tensors the copies move")
    for e in prof.key_averages(group_by_input_shape=True):
        dev = getattr(e, "device_time_total", 0)
        if e.key in ("aten::copy_", "aten::where", "aten::cat", "aten::argmax", "aten::index_copy_",
                     "aten::fill_", "aten::any", "aten::all") and dev > 0:
            print(f"  {e.key:>18} {e.count:6d} {dev:10.1f}  {str(e.input_shapes)[:120]}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()
