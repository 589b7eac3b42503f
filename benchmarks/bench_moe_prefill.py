"""The MoE experts op at prefill token counts on the GPU: HF's bf16 experts module (its grouped_mm
path) against gemma4opt's fp8 experts above the decode kernels' pairs, at the 26b-a4b's dimensions.

    python benchmarks/bench_moe_prefill.py [--tokens 2048 4096] [--groups 16 32 128] [--json rows.jsonl]

Per call: wall ms (CUDA events around the call, median of --repeats after a warm-up; the fp8 path has
one host sync, so no CUDA graph), then the fp8 call's CUDA kernels by total time (torch.profiler),
to see where a prefill's experts time goes. ``--groups`` sets how many experts the fp8 path widens at
once (ops/moe_experts_fp8.py's _GROUP).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemma4opt.ops import moe_experts_fp8 as fp8_op  # noqa: E402
from gemma4opt.ops.fp8 import quantize_rows_reference  # noqa: E402
from gemma4opt.presets import preset_config  # noqa: E402


def _ms(fn, repeats):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="26b-a4b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--groups", type=int, nargs="+", default=[16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    cfg = preset_config(args.preset)
    cfg._experts_implementation = "grouped_mm"
    m = Gemma4TextExperts(cfg).to("cuda", torch.bfloat16)
    H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k_experts
    with torch.no_grad():
        m.gate_up_proj.normal_(0, H ** -0.5)
        m.down_proj.normal_(0, I ** -0.5)
        gu_q, gu_s = quantize_rows_reference(m.gate_up_proj)
        d_q, d_s = quantize_rows_reference(m.down_proj)
    rows = []
    for T in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.rand(T, cfg.num_experts, device="cuda", generator=g).topk(k, -1).indices
        w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), -1)
        busiest = int(torch.bincount(idx.reshape(-1), minlength=cfg.num_experts).max())
        with torch.no_grad():
            ms = _ms(lambda: m(x, idx, w), args.repeats)
            rows.append(dict(preset=args.preset, tokens=T, pairs=T * k, busiest=busiest, system="hf-bf16-grouped_mm",
                             ms=ms))
            print(f"{T:>6} tokens ({T * k} pairs, busiest expert {busiest}): HF bf16 grouped_mm {ms:8.2f} ms", flush=True)
            for group in args.groups:
                fp8_op._GROUP = group
                call = lambda: fp8_op.moe_experts_fp8_grouped(x, idx, w, gu_q, gu_s, d_q, d_s)  # noqa: E731
                ms = _ms(call, args.repeats)
                rows.append(dict(preset=args.preset, tokens=T, pairs=T * k, busiest=busiest,
                                 system=f"gemma4opt-fp8-grouped-{group}", ms=ms))
                print(f"{T:>6} tokens: gemma4opt fp8 grouped, {group} experts widened at once {ms:8.2f} ms", flush=True)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    call()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70))
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, device=torch.cuda.get_device_name())) + "\n")


if __name__ == "__main__":
    main()
