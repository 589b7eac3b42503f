"""gemma4opt::kv_append and gemma4opt::paged_attention — the paged KV cache's two ops.

kv_append(kv, k, v, slot_mapping, token_index): write the step's real tokens (rows
``token_index`` of k/v flattened to [B*T, kv_heads, D]; left padding is skipped) into their slots.

paged_attention(q, kv, meta..., token_index, window, scale, plan_key): q is [B, Tq, H, D]; the
queries of sequence b are its last ``min(Tq, new_lens[b])`` rows (the others are left padding,
output zero). Tq is the step's token count (then the real rows are ``token_index``), or 1 where
HF runs a KV-shared layer on the last token only. Sequence b holds ``seq_lens[b]`` tokens, whose
live pages are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.

CPU: the reference (gather + SDPA). CUDA: FlashInfer's paged kernels, planned once per
step per attention kind on the host (attention/flashinfer.py); ``plan_key`` names that plan;
decode steps use gemma4opt's Triton split-KV kernel (kernels/paged_decode.py), and then
``kv_indices`` is the kind's device page table [max_batch, ring] and ``seq_lens`` the lengths
(one per query row: graphed steps of several tokens per sequence run one row per token);
kv_append is a Triton kernel (kernels/kv_append.py). Nothing here reads a device value on the host.
"""
from __future__ import annotations

import torch

from gemma4opt.attention.reference import kv_append_reference, paged_attention_reference


@torch.library.custom_op("gemma4opt::kv_append", mutates_args=("kv",))
def kv_append(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              token_index: torch.Tensor) -> None:
    kv_append_rows_reference(kv, k, v, slot_mapping, token_index)


def kv_append_rows_reference(kv, k, v, slot_mapping, token_index) -> None:
    """The CPU path and the Triton kernel's oracle: gather the real rows, store them by slot."""
    flat_k = k.reshape(-1, k.shape[-2], k.shape[-1]).index_select(0, token_index)
    flat_v = v.reshape(-1, v.shape[-2], v.shape[-1]).index_select(0, token_index)
    kv_append_reference(kv, flat_k, flat_v, slot_mapping)


@kv_append.register_fake
def _(kv, k, v, slot_mapping, token_index):
    return None


@kv_append.register_kernel("cuda")
def _(kv, k, v, slot_mapping, token_index):
    from gemma4opt.kernels.kv_append import kv_append_triton

    kv_append_triton(kv, k, v, slot_mapping, token_index)


@torch.library.custom_op("gemma4opt::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    kv_last_page_len: torch.Tensor, kv_start: torch.Tensor, seq_lens: torch.Tensor,
                    new_lens: torch.Tensor, token_index: torch.Tensor, window: int, scale: float,
                    plan_key: int) -> torch.Tensor:
    B, Tq = q.shape[:2]
    n = torch.clamp(new_lens, max=Tq)
    rows = torch.arange(Tq, device=q.device)[None, :] >= (Tq - n)[:, None]       # [B, Tq] real query rows
    qo_indptr = torch.zeros(B + 1, dtype=torch.int32, device=q.device)
    qo_indptr[1:] = torch.cumsum(n, 0)
    out = torch.zeros_like(q)
    out[rows] = paged_attention_reference(q[rows], kv, kv_indptr, kv_indices, kv_last_page_len, kv_start, qo_indptr,
                                          seq_lens, window if window > 0 else None, scale).to(q.dtype)
    return out


def paged_attention_flashinfer(q, kv, kv_indptr, kv_indices, kv_last_page_len, kv_start, seq_lens, new_lens,
                               token_index, window, scale, plan_key):
    """The CUDA implementation (FlashInfer planned by the step, or at decode steps the Triton kernel on
    the page table; other metadata tensors unused here)."""
    from gemma4opt.attention.flashinfer import run_planned, uses_triton

    B, Tq = q.shape[:2]
    if Tq > 1 and uses_triton(plan_key):
        # A graphed step of Tq new tokens per sequence (a draft to verify): one query row per
        # token over the page table, no plan (StepContext.begin_token_step staged the lengths).
        flat = run_planned(plan_key, q.reshape(B * Tq, *q.shape[2:]).contiguous(), kv, window, scale,
                           pages=(kv_indices, seq_lens), tokens=Tq)
        return flat.reshape(q.shape)
    if Tq == 1:
        # Decode, or a KV-shared layer at prefill (HF runs those on the last token only): one
        # query per sequence, always a real token. Shapes alone tell which plan (no device read).
        flat = run_planned(plan_key, q.reshape(B, *q.shape[2:]).contiguous(), kv, window, scale,
                           last_only=token_index.shape[0] != B, pages=(kv_indices, seq_lens))
        return flat.reshape(q.shape)
    if token_index.shape[0] > B * Tq:
        raise ValueError(f"gemma4opt.paged_attention: {Tq} query rows per sequence but the step has more tokens; "
                         "queries must be the whole step or its last token (logits_to_keep=1)")
    flat = run_planned(plan_key, q.reshape(B * Tq, *q.shape[2:]).index_select(0, token_index).contiguous(), kv,
                       window, scale, last_only=False)
    out = torch.zeros(B * Tq, *q.shape[2:], dtype=q.dtype, device=q.device)
    out.index_copy_(0, token_index.long(), flat.to(q.dtype))
    return out.reshape(q.shape)


paged_attention.register_kernel("cuda")(paged_attention_flashinfer)


@paged_attention.register_fake
def _(q, kv, kv_indptr, kv_indices, kv_last_page_len, kv_start, seq_lens, new_lens, token_index, window, scale,
      plan_key):
    return torch.empty_like(q)
