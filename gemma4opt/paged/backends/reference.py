"""The reference backend: gather pages + SDPA. The CPU path, and the oracle for the other two.

KV layout per layer is FlashInfer's NHD paged layout: ``kv[num_pages, 2, page_size, kv_heads, D]``.
Queries are ragged: ``q[total_new_tokens, heads, D]`` with ``qo_indptr``. A query at absolute
position p sees keys at positions k with k <= p and, for sliding layers, p - k < window
(HF's bound: the window counts the query itself). An fp8 pool is read as ``q.float() * scale``
with the layer's ``kv_scale`` [k, v] (ops/kv_append.py), cast to the queries' dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gemma4opt.ops.kv_append import check_kv_scale, kv_dequantize
from gemma4opt.paged.backends.base import Backend, KindGeometry


def paged_attention_reference(q, kv, kv_indptr, kv_indices, kv_last_page_len, kv_start, qo_indptr, seq_lens,
                              window: int | None, scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[total_q, heads, D]; every argument but q/kv/kv_scale is a small int tensor (read on the host here)."""
    check_kv_scale(kv, kv_scale, "paged_attention")
    ks, vs = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (None, None)
    ps, kv_heads = kv.shape[2], kv.shape[3]
    heads = q.shape[1]
    out = torch.empty_like(q)
    indptr, qo, lens = kv_indptr.tolist(), qo_indptr.tolist(), seq_lens.tolist()
    last, start = kv_last_page_len.tolist(), kv_start.tolist()
    for i in range(len(lens)):
        pages = kv_indices[indptr[i]:indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * ps + last[i] if len(pages) else 0
        keys = kv_dequantize(kv[pages, 0].reshape(-1, kv_heads, kv.shape[-1])[:kv_len], ks, q.dtype)
        vals = kv_dequantize(kv[pages, 1].reshape(-1, kv_heads, kv.shape[-1])[:kv_len], vs, q.dtype)
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


@torch.library.custom_op("gemma4opt::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    kv_last_page_len: torch.Tensor, kv_start: torch.Tensor, seq_lens: torch.Tensor,
                    new_lens: torch.Tensor, window: int, scale: float,
                    kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Tq, H, D]: the queries of sequence b are its last ``min(Tq, new_lens[b])`` rows (the
    others are left padding, output zero). Tq is the step's token count, or 1 where HF runs a
    KV-shared layer on the last token only. Sequence b holds ``seq_lens[b]`` tokens, whose live
    pages are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``. ``kv_scale``: an fp8 pool's [k, v] scales."""
    B, Tq = q.shape[:2]
    n = torch.clamp(new_lens, max=Tq)
    rows = torch.arange(Tq, device=q.device)[None, :] >= (Tq - n)[:, None]       # [B, Tq] real query rows
    qo_indptr = torch.zeros(B + 1, dtype=torch.int32, device=q.device)
    qo_indptr[1:] = torch.cumsum(n, 0)
    out = torch.zeros_like(q)
    out[rows] = paged_attention_reference(q[rows], kv, kv_indptr, kv_indices, kv_last_page_len, kv_start, qo_indptr,
                                          seq_lens, window if window > 0 else None, scale, kv_scale).to(q.dtype)
    return out


@paged_attention.register_fake
def _(q, kv, kv_indptr, kv_indices, kv_last_page_len, kv_start, seq_lens, new_lens, window, scale, kv_scale=None):
    return torch.empty_like(q)


class ReferenceBackend(Backend):
    """Every step of every geometry, on any device: page lists on the device, read on the host."""

    name = "reference"
    op_name = "paged_attention"
    device_fields = op_fields = ("kv_indptr", "kv_indices", "kv_last_page_len", "kv_start", "seq_lens")
    needs_new_lens = True

    def __init__(self, geometry: KindGeometry):
        super().__init__(geometry)
        self.steps = 0

    def prepare(self, host, dev, pad_to) -> None:
        self.steps += 1

    def attend(self, q, kv, meta, token_index, new_lens, window, scale, kv_scale=None, layer=-1):
        return torch.ops.gemma4opt.paged_attention(q, kv, meta["kv_indptr"], meta["kv_indices"],
                                                   meta["kv_last_page_len"], meta["kv_start"], meta["seq_lens"],
                                                   new_lens, window, scale, kv_scale)

    def stats(self):
        return {"steps": self.steps}
