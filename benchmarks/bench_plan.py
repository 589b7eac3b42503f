"""Host time per decode step for paged-KV metadata + staging + FlashInfer plan, batch 1 to 512.

    python benchmarks/bench_plan.py [--context 4096] [--page-size 16] [--device cuda]

Per step, for a sliding (window, head_dim 256) and a full (head_dim 512) kind with the 31b
preset's heads: PagedSequences.step (page alloc/free, indptr, indices, last_page_len, slot
mapping; numpy), HostStaging (one int32 buffer, one async copy; pinned on CUDA), and on CUDA
with FlashInfer, one plan() per kind from host arrays: what StepContext.begin_step does. The
cost is per step and per attention kind, not per layer. Next to it, FlashInfer's plan() fed
device tensors (it copies them back to the host: a sync per plan), the naive way.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from gemma4opt.paged.tables import PagedSequences, PagePool
from gemma4opt.paged.staging import HostStaging

# Page-list fields staged per step: what the FlashInfer backend (plan) or the reference backend (op) reads.
FLASHINFER_FIELDS = ("kv_indices", "slot_mapping")
REFERENCE_FIELDS = ("kv_indptr", "kv_indices", "kv_last_page_len", "kv_start", "seq_lens", "slot_mapping")

KINDS = (("sliding", 32, 16, 256), ("full", 32, 4, 512))   # name, q heads, kv heads, head_dim (31b)


def _plans(args, device):
    if device != "cuda":
        return None
    from gemma4opt.paged.backends.base import KindGeometry
    from gemma4opt.paged.backends.flashinfer import FlashInferBackend, available, workspace_bytes

    if available() is not None:
        print(f"# FlashInfer: {available()} -> plan() not measured")
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ws = torch.empty(workspace_bytes([k[1:] for k in KINDS], max(args.batch), sms), dtype=torch.uint8, device=device)
    max_pages = max(args.batch) * (-(-(args.context + args.steps + 8) // args.page_size) + 1)
    return [FlashInferBackend(KindGeometry(f"{name}_attention", h, kvh, d, args.page_size,
                                           args.window if name == "sliding" else None, torch.bfloat16,
                                           torch.bfloat16, device=device),
                              ws, max_pages=max_pages, fast_replan=not args.full_plan)
            for name, h, kvh, d in KINDS]


def begin_step_cost(args) -> None:
    """Host µs of StepContext.begin_step for graphed decode steps with the Triton decode kernel
    (the default): page bookkeeping of both kinds, lengths and slots, the table updates, the one
    staged copy and the device-table scatter; no plan. Prefill runs the reference backend (its
    planning is not timed); decode steps the Triton backend."""
    import dataclasses
    import types

    from transformers import Gemma4TextConfig

    from gemma4opt import Gemma4OptConfig
    from gemma4opt.paged.backends import KindBackends
    from gemma4opt.paged.backends.triton import TritonDecodeBackend
    from gemma4opt.paged.step import StepContext

    # Host work does not depend on head sizes: a small pool, the 31b's layer kinds and window.
    cfg = Gemma4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1, head_dim=16,
                           global_head_dim=16, sliding_window=args.window, hidden_size_per_layer_input=0,
                           layer_types=["sliding_attention", "full_attention"])
    print(f"# StepContext.begin_step, Triton decode (no plan), graph buckets, context {args.context} (lengths from "
          f"context/2 to context), page size {args.page_size}, window {args.window}, {args.device}; µs per decode "
          "step (host, both kinds; median, mean in brackets)")
    for b in args.batch:
        oc = Gemma4OptConfig(attention="paged", max_batch_size=b, page_size=args.page_size,
                             max_seq_len=args.context + args.steps + 16).resolve("cpu")
        ctx = StepContext(cfg, dataclasses.replace(oc, cuda_graphs=True), args.device, torch.bfloat16)
        ctx.use_backends({k: KindBackends(kb.prefill, TritonDecodeBackend(kb.prefill.geometry))
                          for k, kb in ctx.backends.items()})
        cache = types.SimpleNamespace(rows=None)
        lens = np.random.default_rng(b).integers(args.context // 2, args.context + 1, size=b)
        mask = torch.from_numpy((np.arange(args.context)[None] >= (args.context - lens)[:, None]).astype(np.int64))
        ctx.begin_step(cache, b, args.context, mask)
        bucket = ctx.bucket(b)
        t = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            ctx.begin_step(cache, b, 1, None, pad_to=bucket)
            t.append(time.perf_counter() - t0)
        print(f"{b:>6} {np.median(t) * 1e6:7.1f} ({np.mean(t) * 1e6:5.0f})", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--staged", choices=["auto", "flashinfer", "reference"], default="auto",
                    help="arrays staged per step: what FlashInfer needs on the device (CUDA) or what the reference "
                         "attention reads (CPU); auto = by device")
    ap.add_argument("--aligned", action="store_true",
                    help="every sequence at the same length (page crossings all on one step); default: lengths "
                         "uniform in [context/2, context], so some sequence crosses a page almost every step")
    ap.add_argument("--graph", action="store_true",
                    help="plan as decode graphs do (graph-mode wrapper per batch bucket; FlashInfer's plan() once, "
                         "then gemma4opt's fast replan: paged/backends/flashinfer_replan.py)")
    ap.add_argument("--full-plan", action="store_true", help="with --graph: FlashInfer's plan() every step")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the plan() calls of the last batch size (where host time goes)")
    ap.add_argument("--begin-step", action="store_true",
                    help="time StepContext.begin_step with the Triton decode kernel (no FlashInfer plan) instead")
    args = ap.parse_args(argv)
    if args.begin_step:
        return begin_step_cost(args)
    ps = args.page_size
    plans = _plans(args, args.device)
    staged = args.staged if args.staged != "auto" else ("flashinfer" if args.device == "cuda" else "reference")
    fields = FLASHINFER_FIELDS if staged == "flashinfer" else REFERENCE_FIELDS
    print(f"# context {args.context} ({'all equal' if args.aligned else 'lengths from context/2 to context'}), "
          f"staged for {staged}, "
          f"page size {ps}, window {args.window}, {args.device}; µs per decode step "
          "(host, both kinds; median over steps, mean in brackets)")
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    print(f"{'batch':>6} {'metadata':>14} {'+ staging':>14} {'+ plan':>14} {'naive plan':>14}")
    for b in args.batch:
        pages = b * (-(-(args.context + args.steps + 8) // ps) + 1)
        kinds = [PagedSequences(PagePool(pages, ps), b, args.context + args.steps + 8, w, max_step_tokens=args.context)
                 for w in (args.window, None)]
        staging = HostStaging(args.device)
        rows = np.arange(b)
        lens = (np.full(b, args.context) if args.aligned
                else np.random.default_rng(b).integers(args.context // 2, args.context + 1, size=b))
        for s in kinds:
            s.step(rows, lens)                                # prefill
        ones = np.ones(b, dtype=np.int64)
        t = {k: [] for k in ("meta", "staged", "planned", "naive")}
        for _ in range(args.steps):
            t0 = time.perf_counter()
            metas = [s.step(rows, ones, decode=True) for s in kinds]
            t1 = time.perf_counter()
            arrays = {f"{i}.{f}": getattr(m, f) for i, m in enumerate(metas) for f in fields}
            arrays["token_index"] = rows
            dev = staging.stage(arrays)
            t2 = time.perf_counter()
            if plans:
                if prof is not None and b == args.batch[-1]:
                    prof.enable()
                for i, (m, p) in enumerate(zip(metas, plans)):
                    p.plan(m.qo_indptr, m.kv_indptr, m.kv_last_page_len, dev[f"{i}.kv_indices"],
                           bucket=b if args.graph else None)
                if prof is not None:
                    prof.disable()
            t3 = time.perf_counter()
            if plans:
                for i, (m, p) in enumerate(zip(metas, plans)):
                    h, kvh, d = p.heads
                    p.wrapper.plan(*(torch.from_numpy(a).to(args.device) for a in (  # one copy each, plan reads back
                        m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len)), h, kvh, d, ps, causal=True,
                                   window_left=(p.window - 1) if p.window else -1, sm_scale=1.0,
                                   q_data_type=p.dtype, kv_data_type=p.dtype)
            t4 = time.perf_counter()
            for k, v in zip(t, (t1 - t0, t2 - t0, t3 - t0, t4 - t3)):
                t[k].append(v)
        cells = [f"{np.median(t[k]) * 1e6:7.1f} ({np.mean(t[k]) * 1e6:5.0f})" if plans or k in ("meta", "staged")
                 else f"{'-':>14}" for k in t]
        print(f"{b:>6} " + " ".join(f"{c:>14}" for c in cells), flush=True)
    if plans and args.graph:
        print("# decode-graph plans: " + ", ".join(f"{KINDS[i][0]}: {p.replan.summary() if p.replan else 'full'}"
                                                  for i, p in enumerate(plans)))
    if prof is not None and plans:
        import pstats

        print(f"# cProfile of plan() at batch {args.batch[-1]}, {args.steps} steps")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
