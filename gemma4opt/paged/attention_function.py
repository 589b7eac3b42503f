"""The attention function HF's Gemma-4 layers call when an optimized model runs on a paged cache.

Registered in transformers' AttentionInterface under ATTN_NAME (its extension point; no HF
class is patched). It is selected only on the optimized model's own copy of its config, and
only for the length of a call on a paged cache (paged/install.py ``paged_attention_on``);
every other call, and every other model, runs its own attention implementation.
"""
from __future__ import annotations

import torch

ATTN_NAME = "gemma4opt_paged"


def paged_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, **kwargs):
    ctx = getattr(module, "_gemma4opt_ctx", None)
    if ctx is None or not ctx.active:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    kind = module.layer_type
    owner = ctx.producer[module.layer_idx]       # KV-shared layers read their producer's pages
    kv = ctx.kv[owner]
    kv_scale = ctx.kv_scale.get(owner)           # an fp8 pool's [k, v] scales; None otherwise
    meta = ctx.meta[kind]
    if not module.is_kv_shared_layer:
        torch.ops.gemma4opt.kv_append(kv, key.transpose(1, 2), value.transpose(1, 2), meta["slot_mapping"],
                                      ctx.token_index, kv_scale)
    # The step's backend for this kind (StepContext picks it): Dynamo guards on which one it is,
    # so a step that picks another runs another graph.
    scale = float(scaling if scaling is not None else module.scaling)
    out = ctx.route[kind].attend(query.transpose(1, 2), kv, meta, ctx.token_index, ctx.new_lens,
                                 int(module.sliding_window or -1), scale, kv_scale, owner)
    return out, None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
