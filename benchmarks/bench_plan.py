"""Host time per decode step for the paged-KV metadata (both attention kinds), batch 1 to 512.

    python benchmarks/bench_plan.py [--context 4096] [--page-size 16]

Measures StepContext-style work: PagedSequences.step for a sliding and a full kind (page
alloc/free, indptr, indices, last_page_len, slot mapping, all numpy) plus the int tensors
handed to the graph. The cost is per step and per attention kind, not per layer. FlashInfer's
plan() is not included yet (it runs on the GPU machine once the FlashInfer path lands).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from gemma4opt.attention.pages import PagedSequences, PagePool


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    args = ap.parse_args(argv)
    ps = args.page_size
    print(f"# context {args.context}, page size {ps}, window {args.window}; µs per decode step (host)")
    print(f"{'batch':>6} {'metadata µs':>12} {'+ tensors µs':>13} {'mean µs':>8}   (median over steps; a step that"
          " adds or frees a page rebuilds the page lists, the others reuse them)")
    for b in args.batch:
        pages = b * (-(-(args.context + args.steps + 8) // ps) + 1)
        kinds = [PagedSequences(PagePool(pages, ps), b, args.context + args.steps + 8, w, max_step_tokens=args.context)
                 for w in (args.window, None)]
        rows = np.arange(b)
        for s in kinds:
            s.step(rows, np.full(b, args.context))           # prefill
        ones = np.ones(b, dtype=np.int64)
        t_meta, t_all = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            metas = [s.step(rows, ones) for s in kinds]
            t1 = time.perf_counter()
            for m in metas:
                for a in (m.kv_indptr, m.kv_indices, m.kv_last_page_len, m.kv_start, m.seq_lens, m.slot_mapping):
                    torch.from_numpy(a)
            t2 = time.perf_counter()
            t_meta.append(t1 - t0)
            t_all.append(t2 - t0)
        print(f"{b:>6} {np.median(t_meta) * 1e6:>12.1f} {np.median(t_all) * 1e6:>13.1f} {np.mean(t_all) * 1e6:>8.1f}")


if __name__ == "__main__":
    main()
