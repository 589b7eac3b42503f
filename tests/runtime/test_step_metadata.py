"""StepContext's per-step metadata as the attention ops see it: rebuilt only when the layout or
the backends change; each backend's op gets what it reads and nothing else."""
import dataclasses
import types

import numpy as np
import torch

from gemma4opt import Gemma4OptConfig
from gemma4opt.paged.step import StepContext
from tests.models import tiny


def _table_backends(ctx):
    """Each kind decoding on the Triton backend (its CPU op is the reference), prefill on the reference."""
    from gemma4opt.paged.backends import KindBackends
    from gemma4opt.paged.backends.triton import TritonDecodeBackend

    return {k: KindBackends(kb.prefill, TritonDecodeBackend(kb.prefill.geometry)) for k, kb in ctx.backends.items()}


def _context():
    cfg = tiny("tiny").config
    oc = Gemma4OptConfig(attention="paged", max_batch_size=2, page_size=4, max_seq_len=64).resolve("cpu")
    ctx = StepContext(cfg, dataclasses.replace(oc, cuda_graphs=True), "cpu", torch.float32)
    ctx.use_backends(_table_backends(ctx))
    return ctx


def test_decode_steps_reuse_their_bound_metadata_until_the_backends_change():
    ctx = _context()
    cache = types.SimpleNamespace(rows=None)
    ctx.begin_step(cache, 2, 5, None)                                  # prefill
    # The reference's op reads the page lists; its metadata is those and kv_append's slots.
    assert set(ctx.meta["full_attention"]) == {"slot_mapping", "kv_indptr", "kv_indices", "kv_last_page_len",
                                               "kv_start", "seq_lens"}
    assert ctx.route["full_attention"].name == "reference" and ctx.new_lens is not None
    ctx.begin_step(cache, 2, 1, None, pad_to=2)      # takes the next pages: table writes staged too
    ctx.begin_step(cache, 2, 1, None, pad_to=2)
    first = ctx.meta
    ctx.begin_step(cache, 2, 1, None, pad_to=2)
    assert ctx.meta is first, "same layout: the same tensors, nothing rebuilt"
    assert ctx.meta["full_attention"]["seq_lens"].tolist() == [8, 8]   # this step's contents, in place
    assert set(ctx.meta["full_attention"]) == {"table", "seq_lens", "slot_mapping"}     # the Triton op's, no more
    assert ctx.route["full_attention"].name == "triton" and ctx.new_lens is None
    assert ctx.meta["full_attention"]["table"] is ctx.tables["full_attention"]
    ctx.use_backends(_table_backends(ctx))                             # new device tables
    ctx.begin_step(cache, 2, 1, None, pad_to=2)
    for kind in ("sliding_attention", "full_attention"):
        assert ctx.meta[kind]["table"] is ctx.tables[kind], "bound to the current tables, not the old"
    table = ctx.tables["full_attention"].numpy()
    assert np.array_equal(table, ctx.seqs["full_attention"].table), "the new mirror holds the host's pages"
