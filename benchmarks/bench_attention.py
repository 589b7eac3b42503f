"""FlashInfer decode attention on the 31b geometry: time per layer against the KV bytes it reads.

    python benchmarks/bench_attention.py                      # batch 1 32 64, context 160 4096
    python benchmarks/bench_attention.py --batch 32 --context 4096 --variants prefill decode

Per attention kind (sliding: 32 q / 16 kv heads, head_dim 256, window 1024; full: 32 q / 4 kv
heads, head_dim 512) and per way of running one decode query per sequence over paged KV:
``prefill`` (BatchPrefillWithPagedKVCacheWrapper, FA3 where it exists), ``fa2`` (the same on FA2:
what gemma4opt's decode graphs run), ``decode``
(BatchDecodeWithPagedKVCacheWrapper on CUDA cores) and ``decode-tc`` (the same with tensor
cores), and ``triton``: gemma4opt's own split-KV decode kernel (kernels/paged_decode.py, what
decode steps run by default; no plan; ``triton-bN-wW-sS[-rR]`` tries another BLOCK_N / warps / stages / register cap,
``-f16`` fp16 dots over an fp8 pool, ``-v8`` its v tile staged in fp8).
Each is timed as a CUDA graph of 20 runs (no launch or Python overhead), and the KV bytes
a step must read (window-limited) over that time is compared with the measured copy bandwidth.

``--split`` (``fa2`` only) sets how FlashInfer splits each sequence's KV across CTAs: ``auto``
(its planner: chunks of at least 128 tokens) or ``cN`` (N chunks per sequence, via
fixed_split_size). Not offered: disable_split_kv, which in CUDA-graph mode (FlashInfer 0.6.18)
leaves the padded CTAs without a valid mask, reading stale schedules (an H200 run faulted).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import copy_bandwidth  # noqa: E402

KINDS = {"sliding": dict(heads=32, kv_heads=16, head_dim=256, window=1024),
         "full": dict(heads=32, kv_heads=4, head_dim=512, window=None)}
PAGE = 16


def _wrapper(variant, workspace, batch, max_pages, head_dim):
    import flashinfer

    def buf(n):
        return torch.empty(n, dtype=torch.int32, device="cuda")

    if variant in ("prefill", "fa2"):
        backend = "fa2" if head_dim > 256 or variant == "fa2" else "auto"
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", backend=backend, use_cuda_graph=True, qo_indptr_buf=buf(batch + 1),
            paged_kv_indptr_buf=buf(batch + 1), paged_kv_indices_buf=buf(max_pages), paged_kv_last_page_len_buf=buf(batch))
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=variant == "decode-tc",
        paged_kv_indptr_buffer=buf(batch + 1), paged_kv_indices_buffer=buf(max_pages),
        paged_kv_last_page_len_buffer=buf(batch))


def _split_args(split, pages_per_seq):
    if split == "auto":
        return {}
    return dict(fixed_split_size=-(-pages_per_seq // int(split[1:])))


def run_case(kind, variant, batch, context, workspace, bw, reps=20, split="auto", kv_dtype="bf16"):
    g = KINDS[kind]
    h, kvh, d, window = g["heads"], g["kv_heads"], g["head_dim"], g["window"]
    pages_per_seq = -(-context // PAGE)
    n_pages = batch * pages_per_seq
    kv = torch.randn(n_pages, 2, PAGE, kvh, d, device="cuda", dtype=torch.bfloat16)
    fp8 = kv_dtype == "fp8"
    if fp8:         # an fp8 pool (kv_cache_dtype="fp8"): the Triton decode kernel only
        if not variant.startswith("triton"):
            raise ValueError(f"{variant} is not run on an fp8 pool here (decode steps run the Triton kernel)")
        kv = kv.to(torch.float8_e4m3fn)
    q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)
    indptr = torch.arange(0, n_pages + 1, pages_per_seq, dtype=torch.int32)
    indices = torch.randperm(n_pages, dtype=torch.int32).cuda()
    last = torch.full((batch,), context - (pages_per_seq - 1) * PAGE, dtype=torch.int32)
    if variant.startswith("triton"):
        from gemma4opt.kernels.paged_decode import paged_decode_triton

        # The kernel reads a page table: row b's pages in order (ring = pages per sequence).
        table = indices.view(batch, pages_per_seq)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        cfg = None
        if variant != "triton":         # triton-bN-wW-sS[-rR][-f16][-v8], triton-f16
            keys = dict(b="block_n", w="num_warps", s="num_stages", r="maxnreg")
            parts = variant.split("-")[1:]
            cfg = {keys[x[0]]: int(x[1:]) for x in parts if x not in ("f16", "v8")}
            cfg["f16"] = "f16" in parts
            cfg["v_wide"] = "v8" not in parts      # -v8: v staged in fp8 (see the kernel's V_WIDE)
        kv_scale = torch.ones(2, dtype=torch.float32, device="cuda") if fp8 else None
        return _time(lambda: paged_decode_triton(q, kv, table, lens, window=window or 0, scale=1.0, num_sms=sms,
                                                 config=cfg, kv_scale=kv_scale),
                     reps, kind, variant, batch, context, window, kvh, d, bw, kv.element_size())
    w = _wrapper(variant, workspace, batch, n_pages, d)
    common = dict(window_left=window - 1 if window else -1, sm_scale=1.0, q_data_type=torch.bfloat16,
                  kv_data_type=torch.bfloat16)
    if variant in ("prefill", "fa2"):
        w.plan(torch.arange(batch + 1, dtype=torch.int32), indptr, indices, last, h, kvh, d, PAGE, causal=True,
               **common, **(_split_args(split, pages_per_seq) if variant == "fa2" else {}))
    else:
        w.plan(indptr, indices, last, h, kvh, d, PAGE, **common)
    label = variant if variant != "fa2" else f"fa2-{split}"
    return _time(lambda: w.run(q, kv), reps, kind, label, batch, context, window, kvh, d, bw)


def _time(run, reps, kind, label, batch, context, window, kvh, d, bw, elem=2):
    run()                                            # JIT / warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps * 1e3)
    us = min(times)
    seen = min(context, window) if window else context
    kv_bytes = batch * seen * kvh * d * 2 * elem
    return dict(kind=kind, variant=label, kv_dtype="fp8" if elem == 1 else "bf16", batch=batch, context=context,
                us=us, kv_mb=kv_bytes / 1e6, gb_s=kv_bytes / us / 1e3, bw_frac=kv_bytes / (us * 1e-6) / bw)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[160, 4096])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--variants", nargs="+", default=["prefill", "decode", "decode-tc"],
                    help="prefill fa2 decode decode-tc triton, or triton-bN-wW-sS (BLOCK_N, warps, stages); "
                         "-rR: a register cap; -f16: an fp8 pool's dots in fp16; -v8: its v tile staged in fp8")
    ap.add_argument("--split", nargs="+", default=["auto"], help="fa2 only: auto or cN (N chunks per sequence)")
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"],
                    help="the pool's dtype; fp8 (e4m3, scale 1) runs the triton variants only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    bw = copy_bandwidth("cuda")
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s; {args.kv_dtype} KV, page size {PAGE}; us per layer (CUDA graph of 20)")
    print(f"{'kind':>8} {'variant':>10} {'batch':>5} {'context':>7} {'us':>8} {'KV MB':>8} {'GB/s':>7} {'of copy':>7}")
    rows = []
    for kind in args.kinds:
        for variant, split in [(v, sp) for v in args.variants for sp in (args.split if v == "fa2" else ["auto"])]:
            label = variant if variant != "fa2" else f"fa2-{split}"
            for context in args.context:
                for batch in args.batch:
                    try:
                        r = run_case(kind, variant, batch, context, workspace, bw, split=split, kv_dtype=args.kv_dtype)
                    except Exception as e:      # a variant FlashInfer lacks for this geometry
                        print(f"{kind:>8} {label:>10} {batch:>5} {context:>7}  unsupported: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
                        continue
                    rows.append(r)
                    print(f"{kind:>8} {r['variant']:>10} {batch:>5} {context:>7} {r['us']:>8.1f} {r['kv_mb']:>8.1f} "
                          f"{r['gb_s']:>7.0f} {r['bw_frac']:>6.0%}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
