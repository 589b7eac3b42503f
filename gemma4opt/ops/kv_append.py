"""gemma4opt::kv_append — the paged KV cache's write, the same for every attention backend.

kv_append(kv, k, v, slot_mapping, token_index, kv_scale=None): write the step's real tokens (rows
``token_index`` of k/v flattened to [B*T, kv_heads, D]; left padding is skipped) into their slots
of the pool ``kv[num_pages, 2, page_size, kv_heads, D]`` (FlashInfer's NHD paged layout).
CPU: the reference below; CUDA: a Triton kernel (kernels/kv_append.py). The attention ops that
read the pool are the backends' (gemma4opt/paged/backends/).

An fp8 pool (``Gemma4OptConfig(kv_cache_dtype="fp8")``, e4m3) stores
``clamp(x.float() / scale, -448, 448)`` rounded to nearest even, with ``kv_scale`` [2] fp32 the
layer's scales for k and v, and is read back as ``q.float() * scale`` (``kv_dequantize``). The
default scales are 1.0: sound for Gemma-4 in particular, whose k (k_norm, learned weight) and v
(v_norm, no weight) are RMS-normalized per head, so |k| and |v| are O(1) (RMS 1 times the
k_norm weight), far inside e4m3's +-448, and e4m3 keeps 3 mantissa bits from 2^-6 up (subnormal
down to 2^-9). The scales are tensors, so calibrated ones can be set without retracing.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8 import FP8_DTYPE, FP8_MAX

KV_FP8 = FP8_DTYPE           # the fp8 KV pool's dtype (e4m3, the same as the fp8 weights')


def kv_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (IEEE division in fp32: a tensor divisor), clamped to +-448, as e4m3."""
    return torch.clamp(x.float() / scale, -FP8_MAX, FP8_MAX).to(KV_FP8)


def kv_dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Pool values as ``dtype``: fp8 pages times their scale (in fp32, then cast); others cast."""
    if q.dtype == KV_FP8:
        return (q.float() * scale).to(dtype)
    return q.to(dtype)


def check_kv_scale(kv: torch.Tensor, kv_scale: torch.Tensor | None, op: str) -> None:
    """An fp8 pool needs its layer's [2] fp32 scales (k, v); others take none."""
    if kv.dtype == KV_FP8:
        if kv_scale is None or kv_scale.shape != (2,) or kv_scale.dtype != torch.float32:
            raise ValueError(f"gemma4opt.{op}: an fp8 KV pool needs kv_scale, the layer's fp32 scales [k, v]; got "
                             f"{None if kv_scale is None else (tuple(kv_scale.shape), kv_scale.dtype)}")


def kv_append_reference(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_scale: torch.Tensor | None = None) -> None:
    """Write new tokens' K/V ([T, kv_heads, D]) into their slots, in place (quantized into an fp8 pool)."""
    ps = kv.shape[2]
    page, off = slot_mapping // ps, slot_mapping % ps
    check_kv_scale(kv, kv_scale, "kv_append")
    if kv.dtype == KV_FP8:
        k, v = kv_quantize(k, kv_scale[0]), kv_quantize(v, kv_scale[1])
    kv[page, 0, off] = k.to(kv.dtype)
    kv[page, 1, off] = v.to(kv.dtype)


def kv_append_rows_reference(kv, k, v, slot_mapping, token_index, kv_scale=None) -> None:
    """The CPU path and the Triton kernel's oracle: gather the real rows, store them by slot."""
    flat_k = k.reshape(-1, k.shape[-2], k.shape[-1]).index_select(0, token_index)
    flat_v = v.reshape(-1, v.shape[-2], v.shape[-1]).index_select(0, token_index)
    kv_append_reference(kv, flat_k, flat_v, slot_mapping, kv_scale)


@torch.library.custom_op("gemma4opt::kv_append", mutates_args=("kv",))
def kv_append(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              token_index: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    kv_append_rows_reference(kv, k, v, slot_mapping, token_index, kv_scale)


@kv_append.register_fake
def _(kv, k, v, slot_mapping, token_index, kv_scale=None):
    return None


@kv_append.register_kernel("cuda")
def _(kv, k, v, slot_mapping, token_index, kv_scale=None):
    from gemma4opt.kernels.kv_append import kv_append_triton

    check_kv_scale(kv, kv_scale, "kv_append")
    kv_append_triton(kv, k, v, slot_mapping, token_index, kv_scale)
