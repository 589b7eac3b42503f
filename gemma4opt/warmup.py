"""warmup(): compile and capture decode graphs before the first real request.

One short greedy generate per batch size, largest first (so the shared graph memory pool is
sized by the largest bucket and smaller captures fit in it): prefill, a warm-up decode step,
then the capture. Twice: Dynamo recompiles while it sees new batch sizes (constant, then
symbolic, and size 1 apart), so a bucket can be captured in a graph that a later, more general
one then serves; the second round runs with every graph compiled, so each bucket is captured in
the graph that will serve it. With the paged cache the batch sizes default to the decode buckets, and the
captures are replayed by every later generate (the KV pool's addresses never change). With
HF's static cache, graphs belong to the cache of one batch size and length, so warm up with the
batch size and lengths you will serve.
"""
from __future__ import annotations

import sys
import time

import torch

# prefill, the step Dynamo compiles with constants, the recompile with symbols (a warm-up), the capture
_STEPS = 4


def warmup(model, batch_sizes=None, prompt_len: int = 8, max_new_tokens: int = _STEPS, progress: bool = True):
    """Run the captures now; returns {batch: seconds}. ``batch_sizes`` defaults to the paged buckets."""
    from gemma4opt.api import get_state

    state = get_state(model)
    if not state.config.cuda_graphs:
        raise ValueError("gemma4opt.warmup: this model was optimized without cuda_graphs; nothing to capture")
    if batch_sizes is None:
        if state.context is None:
            raise ValueError("gemma4opt.warmup: with HF's static cache, pass batch_sizes (the batch you will serve)")
        batch_sizes = state.context.buckets
    sizes = sorted(set(batch_sizes), reverse=True)
    device = next(model.parameters()).device
    done = {}
    runs = sizes * 2
    for i, b in enumerate(runs):
        ids = torch.full((b, prompt_len), 3, dtype=torch.long, device=device)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           min_new_tokens=max_new_tokens, do_sample=False)
        done[b] = done.get(b, 0.0) + time.perf_counter() - t
        if progress:
            bar = "#" * (i + 1) + "." * (len(runs) - i - 1)
            print(f"\rgemma4opt warm-up [{bar}] batch {b}: {done[b]:.1f} s "
                  f"({state.graph_captures} graphs captured)", end="" if i + 1 < len(runs) else "\n",
                  file=sys.stderr, flush=True)
    return done
