"""gemma4opt::qkv_norm_rope_append — a paged layer's q/k/v prep and KV append in one op.

    q_out = rms_norm_rope(q, q_weight, cos, sin, eps)          # returned, [B, S, Hq, D]
    k_new = rms_norm_rope(k, k_weight, cos, sin, eps)
    v_new = rms_norm(v, None, eps)                             # v_norm has no weight
    kv_append(kv, k_new, v_new, slot_mapping, token_index, kv_scale)   # into the paged pool, in place

q, k, v: [B, S, heads, D] views of the merged projection (v may be k itself: attention_k_eq_v).
Only the real rows (``token_index``) reach the pool; q is computed for every row. An fp8 pool
takes k_new and v_new (rounded to the model's dtype, as the unfused ops' outputs are) quantized
with ``kv_scale`` [2] fp32 (ops/kv_append.py).
"""
from __future__ import annotations

import torch

from gemma4opt.ops.kv_append import check_kv_scale, kv_append_rows_reference
from gemma4opt.ops.rms_norm import rms_norm_reference
from gemma4opt.ops.rms_norm_rope import rms_norm_rope_reference


@torch.library.custom_op("gemma4opt::qkv_norm_rope_append", mutates_args=("kv",))
def qkv_norm_rope_append(kv: torch.Tensor, q: torch.Tensor, q_weight: torch.Tensor, k: torch.Tensor,
                         k_weight: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                         slot_mapping: torch.Tensor, token_index: torch.Tensor,
                         kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    return qkv_norm_rope_append_reference(kv, q, q_weight, k, k_weight, v, cos, sin, eps, slot_mapping, token_index,
                                          kv_scale)


def qkv_norm_rope_append_reference(kv, q, q_weight, k, k_weight, v, cos, sin, eps, slot_mapping, token_index,
                                   kv_scale=None):
    """The unfused ops in order: the CPU path and the Triton kernel's oracle."""
    k_new = rms_norm_rope_reference(k, k_weight, cos, sin, eps)
    kv_append_rows_reference(kv, k_new, rms_norm_reference(v, None, eps), slot_mapping, token_index, kv_scale)
    return rms_norm_rope_reference(q, q_weight, cos, sin, eps)


@qkv_norm_rope_append.register_fake
def _(kv, q, q_weight, k, k_weight, v, cos, sin, eps, slot_mapping, token_index, kv_scale=None):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@qkv_norm_rope_append.register_kernel("cuda")
def _(kv, q, q_weight, k, k_weight, v, cos, sin, eps, slot_mapping, token_index, kv_scale=None):
    from gemma4opt.kernels.qkv_norm_rope_append import qkv_norm_rope_append_triton

    check_kv_scale(kv, kv_scale, "qkv_norm_rope_append")
    return qkv_norm_rope_append_triton(kv, q, q_weight, k, k_weight, v, cos, sin, eps, slot_mapping, token_index,
                                       kv_scale=kv_scale)
