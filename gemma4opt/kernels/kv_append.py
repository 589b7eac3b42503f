"""Triton kv_append: a step's real K/V rows into their page slots, one launch per layer.

The op-by-op path costs six kernels per layer (K and V each: a copy out of HF's transposed view,
an index_select of the real rows, an indexed store), ~2-4 µs each at decode; this kernel reads
K and V in place through their strides and writes both. Into an fp8 pool it quantizes with the
layer's k and v scales (ops/kv_append.py states the semantics) through fp8_quant.fp8_quantize,
which rounds as torch does (also under Triton's interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import pdl_flags, pdl_prologue, row_launch
from gemma4opt.kernels.fp8_quant import fp8_quantize


@triton.jit
def _kv_append_kernel(K, V, KV, KV_SCALE, TOKEN_INDEX, SLOTS, T, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                      s_page, s_kv, s_slot, s_head, PAGE_SIZE, D, BLOCK: tl.constexpr, FP8: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_prologue(PDL)
    i = tl.program_id(0)                   # the i-th real token of the step
    h = tl.program_id(1)                   # kv head
    src = tl.load(TOKEN_INDEX + i).to(tl.int64)      # row in the flattened [B * T] step
    b, t = src // T, src % T
    slot = tl.load(SLOTS + i).to(tl.int64)
    dst = (slot // PAGE_SIZE) * s_page + (slot % PAGE_SIZE) * s_slot + h * s_head
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dt = KV.dtype.element_ty
    k = tl.load(K + b * sk_b + t * sk_t + h * sk_h + cols, mask=mask)
    v = tl.load(V + b * sv_b + t * sv_t + h * sv_h + cols, mask=mask)
    if FP8:     # the layer's scales: [k, v] fp32
        tl.store(KV + dst + cols, fp8_quantize(k.to(tl.float32), tl.load(KV_SCALE)), mask=mask)
        tl.store(KV + dst + s_kv + cols, fp8_quantize(v.to(tl.float32), tl.load(KV_SCALE + 1)), mask=mask)
    else:
        tl.store(KV + dst + cols, k.to(dt), mask=mask)
        tl.store(KV + dst + s_kv + cols, v.to(dt), mask=mask)


def kv_append_triton(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                     token_index: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """kv [pages, 2, page_size, kv_heads, D]; k, v [B, T, kv_heads, D] (any strides but unit on D);
    kv_scale [2] fp32 (k, v) for an fp8 pool."""
    fp8 = kv.dtype == torch.float8_e4m3fn
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    n, heads, d = token_index.shape[0], k.shape[2], k.shape[3]
    if n == 0:
        return
    block, warps = row_launch(d)
    _kv_append_kernel[(n, heads)](
        k, v, kv, kv_scale if fp8 else kv, token_index, slot_mapping, k.shape[1], k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        kv.shape[2], d, BLOCK=block, FP8=fp8, num_warps=min(warps, 4), **pdl_flags(kv))
