"""Reference paged attention (the CPU path and the oracle for FlashInfer): gather pages + SDPA.

KV layout per layer is FlashInfer's NHD paged layout: ``kv[num_pages, 2, page_size, kv_heads, D]``.
Queries are ragged: ``q[total_new_tokens, heads, D]`` with ``qo_indptr``. A query at absolute
position p sees keys at positions k with k <= p and, for sliding layers, p - k < window
(HF's bound: the window counts the query itself).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_append_reference(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V ([T, kv_heads, D]) into their slots, in place."""
    ps = kv.shape[2]
    page, off = slot_mapping // ps, slot_mapping % ps
    kv[page, 0, off] = k.to(kv.dtype)
    kv[page, 1, off] = v.to(kv.dtype)


def paged_attention_reference(q, kv, kv_indptr, kv_indices, kv_last_page_len, kv_start, qo_indptr, seq_lens,
                              window: int | None, scale: float) -> torch.Tensor:
    """out[total_q, heads, D]; every argument but q/kv is a small int tensor (read on the host here)."""
    ps, kv_heads = kv.shape[2], kv.shape[3]
    heads = q.shape[1]
    out = torch.empty_like(q)
    indptr, qo, lens = kv_indptr.tolist(), qo_indptr.tolist(), seq_lens.tolist()
    last, start = kv_last_page_len.tolist(), kv_start.tolist()
    for i in range(len(lens)):
        pages = kv_indices[indptr[i]:indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * ps + last[i] if len(pages) else 0
        keys = kv[pages, 0].reshape(-1, kv_heads, kv.shape[-1])[:kv_len]
        vals = kv[pages, 1].reshape(-1, kv_heads, kv.shape[-1])[:kv_len]
        qi = q[qo[i]:qo[i + 1]]
        n = qi.shape[0]
        q_pos = torch.arange(lens[i] - n, lens[i], device=q.device)[:, None]
        k_pos = torch.arange(start[i], start[i] + kv_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= (q_pos - k_pos) < window
        rep = heads // kv_heads
        keys = keys.repeat_interleave(rep, dim=1).transpose(0, 1)       # [heads, kv_len, D]
        vals = vals.repeat_interleave(rep, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(qi.transpose(0, 1)[None], keys[None], vals[None], attn_mask=mask[None, None],
                                           scale=scale)
        out[qo[i]:qo[i + 1]] = o[0].transpose(0, 1)
    return out
