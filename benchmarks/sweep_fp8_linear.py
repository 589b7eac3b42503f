"""Tiles of the skinny FP8 GEMM (kernels/fp8_linear.py) on a preset's decode GEMMs, against
torch._scaled_mm and against the bf16 GEMM of the same shape (cuBLAS), on an H200.

    python3 benchmarks/sweep_fp8_linear.py --presets 31b --m 1 8 32 --json rows.jsonl

Each candidate is timed as ops/pick.py's ``time_in_graph`` times a decode GEMM: calls back to
back in one CUDA graph, each on its own copy of the weight, the copies together twice the L2, so
every call streams its weight from HBM. At one row the candidates are the row-sum tiles (fp32
multiply-and-sum, one e4m3 -> fp32 conversion per weight byte) and the tl.dot tiles with the row
padded to 16 (the fp8 tensor-core MMA does the products; 15 of its 16 rows idle); at 2-32 rows the
tl.dot tiles. Rows: per (preset, M, GEMM) the times in µs, the weight stream's GB/s of the best, and
the five best tiles. The lm_head (vocab x hidden) is one of the GEMMs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemma4opt.kernels.fp8_linear import fp8_linear_triton  # noqa: E402
from gemma4opt.ops.fp8 import fp8_linear_reference, quantize_rows_reference, quantize_weight_reference  # noqa: E402
from gemma4opt.ops.fp8_linear import scaled_mm  # noqa: E402
from gemma4opt.ops.pick import _graph_ms, weight_copies  # noqa: E402
from gemma4opt.presets import preset_config  # noqa: E402


def shapes(cfg) -> list[tuple[str, int, int]]:
    """(name, N, K) of the decode step's GEMMs as optimize() merges them, and the lm_head."""
    H, I, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    out = []
    for kind in ("sliding_attention", "full_attention"):
        if kind not in cfg.layer_types:
            continue
        lc = cfg.per_layer_config[cfg.layer_types.index(kind)]
        k_eq_v = kind == "full_attention" and getattr(cfg, "attention_k_eq_v", False)
        n_qkv = (heads + lc.num_key_value_heads * (1 if k_eq_v else 2)) * lc.head_dim
        out.append((f"qkv {kind.split('_')[0]}", n_qkv, H))
        out.append((f"o_proj {kind.split('_')[0]}", H, heads * lc.head_dim))
    out += [("gate_up", 2 * I, H), ("down", H, I), ("lm_head", cfg.vocab_size, H)]
    return out


def tiles(M: int):
    """(config dict) candidates for M rows."""
    if M == 1:
        for bn in (2, 4, 8, 16):
            for bk in (512, 1024, 2048):
                for warps in (4, 8):
                    yield dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=3)
    bm = 16 if M <= 16 else 32
    for bn in (64, 128):
        for bk in (128, 256, 512):
            for stages in (3, 4, 6):
                if (bn + bm) * bk * stages > 200 * 1024:
                    continue
                for warps in ((4,) if bn == 64 else (4, 8)):
                    for split in (1, 2, 4):
                        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SWAP=True,
                                   num_warps=warps, num_stages=stages)


def sweep(preset: str, M: int, out, only: str | None):
    cfg = preset_config(preset)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name, N, K in shapes(cfg):
        if only and only not in name:
            continue
        torch.manual_seed(0)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        wq, ws = quantize_weight_reference(w)
        xq, xs = quantize_rows_reference(x)
        want = fp8_linear_reference(xq, xs, wq, ws, torch.bfloat16).float()
        copies = weight_copies(wq.numel(), l2)
        wqs = [wq] + [wq.clone() for _ in range(copies - 1)]
        calls = max(8, copies)
        timed = {}
        try:
            timed["scaled_mm"] = _graph_ms(lambda q: scaled_mm(xq, xs, q, ws, torch.bfloat16), wqs, calls, 10) * 1e3
            timed["autotuned"] = _graph_ms(lambda q: fp8_linear_triton(xq, xs, q, ws, torch.bfloat16), wqs, calls,
                                           10) * 1e3
        except RuntimeError as e:
            print(f"# {name}: {type(e).__name__} {str(e)[:100]}", flush=True)
        del wqs
        # bf16 of the same shape through cuBLAS: twice the bytes, the bar fp8 must halve.
        bcopies = weight_copies(w.numel() * 2, l2)
        ws16 = [w] + [w.clone() for _ in range(bcopies - 1)]
        timed["bf16_cublas"] = _graph_ms(lambda q: torch.nn.functional.linear(x, q), ws16, max(8, bcopies), 10) * 1e3
        del ws16
        wqs = [wq] + [wq.clone() for _ in range(copies - 1)]
        for tile in tiles(M):
            try:
                got = fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16, config=tile)
                if not torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2):
                    print(f"# {name} {tile}: wrong result", flush=True)
                    continue
                timed[json.dumps(tile)] = _graph_ms(
                    lambda q: fp8_linear_triton(xq, xs, q, ws, torch.bfloat16, config=tile), wqs, calls, 10) * 1e3
            except Exception as e:      # noqa: BLE001 - a tile the GPU refuses is skipped
                print(f"# {name} {tile}: {type(e).__name__} {str(e)[:80]}", flush=True)
        del wqs
        ranked = sorted((k for k in timed if k.startswith("{")), key=timed.get)
        best = timed[ranked[0]] if ranked else None
        row = dict(preset=preset, M=M, op=f"fp8_linear[{name}]", N=N, K=K,
                   scaled_mm_us=timed.get("scaled_mm"), autotuned_us=timed.get("autotuned"),
                   bf16_cublas_us=timed["bf16_cublas"], best=ranked[:5], best_us=[timed[k] for k in ranked[:5]],
                   gb_s_best=N * K / (best * 1e-6) / 1e9 if best else None)
        print(f"{preset:>6} {M:>3} {name:>16} N={N:>6} K={K:>5} bf16 {timed['bf16_cublas']:8.2f} "
              f"scaled_mm {timed.get('scaled_mm', float('nan')):8.2f} autotuned {timed.get('autotuned', float('nan')):8.2f} "
              f"best {best or float('nan'):8.2f} ({row['gb_s_best'] or 0:.0f} GB/s) {ranked[:1]}", flush=True)
        for k in ranked[1:5]:
            print(f"{'':>40} {timed[k]:8.2f} {k}")
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
        del w, wq


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["31b"])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--only", default=None, help="only the GEMMs whose name contains this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = open(args.json, "a") if args.json else None
    for preset in args.presets:
        for M in args.m:
            sweep(preset, M, out, args.only)


if __name__ == "__main__":
    main()
