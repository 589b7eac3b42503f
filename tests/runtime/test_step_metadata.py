"""StepContext's per-step metadata as the attention ops see it: rebuilt only when the layout or
the plans change."""
import dataclasses
import types

import numpy as np
import torch

from gemma4opt import Gemma4OptConfig
from gemma4opt.runtime.context import StepContext
from tests.models import tiny


class _TritonPlan:
    """Stand-in for a kind whose decode runs the Triton kernel (no FlashInfer plan)."""
    triton_decode, key = True, -1

    def use_triton(self):
        pass

    def plan(self, *args, **kwargs):       # prefill steps (FlashInfer's on a GPU): nothing to check here
        pass


def _context():
    cfg = tiny("tiny").config
    oc = Gemma4OptConfig(attention="paged", max_batch_size=2, page_size=4, max_seq_len=64).resolve("cpu")
    ctx = StepContext(cfg, dataclasses.replace(oc, cuda_graphs=True), "cpu", torch.float32)
    ctx.use_plans({k: _TritonPlan() for k in ("sliding_attention", "full_attention")})
    return ctx


def test_decode_steps_reuse_their_bound_metadata_until_the_plans_change():
    ctx = _context()
    cache = types.SimpleNamespace(rows=None)
    ctx.begin_step(cache, 2, 5, None)                                  # prefill
    ctx.begin_step(cache, 2, 1, None, pad_to=2)      # takes the next pages: table writes staged too
    ctx.begin_step(cache, 2, 1, None, pad_to=2)
    first = ctx.meta
    ctx.begin_step(cache, 2, 1, None, pad_to=2)
    assert ctx.meta is first, "same layout: the same tensors, nothing rebuilt"
    assert ctx.meta["full_attention"]["seq_lens"].tolist() == [8, 8]   # this step's contents, in place
    assert ctx.meta["full_attention"]["kv_indices"] is ctx.tables["full_attention"]
    ctx.use_plans({k: _TritonPlan() for k in ("sliding_attention", "full_attention")})    # new device tables
    ctx.begin_step(cache, 2, 1, None, pad_to=2)
    for kind in ("sliding_attention", "full_attention"):
        assert ctx.meta[kind]["kv_indices"] is ctx.tables[kind], "bound to the current tables, not the old"
    table = ctx.tables["full_attention"].numpy()
    assert np.array_equal(table, ctx.seqs["full_attention"].table), "the new mirror holds the host's pages"
