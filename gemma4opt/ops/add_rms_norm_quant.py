"""gemma4opt::add_rms_norm_quant — gemma4opt::add_rms_norm with its norm output FP8-quantized per row.

    s, n = add_rms_norm(x, residual, weight, eps, scale, next_weight, next_eps)   # ops/add_rms_norm.py
    (q, scales) = quantize_rows(n)                                                # ops/fp8.py
    return s, q, scales          # s: the new residual stream (x.dtype); q, scales: the next GEMM's input

patterns/fp8_quant.py puts it where a residual tail feeds an fp8 GEMM (quantization="fp8").
"""
from __future__ import annotations

import torch

from gemma4opt.ops.add_rms_norm import add_rms_norm_reference
from gemma4opt.ops.fp8 import quantize_rows_reference


@torch.library.custom_op("gemma4opt::add_rms_norm_quant", mutates_args=())
def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       scale: torch.Tensor | None, next_weight: torch.Tensor, next_eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return add_rms_norm_quant_reference(x, residual, weight, eps, scale, next_weight, next_eps)


def add_rms_norm_quant_reference(x, residual, weight, eps, scale, next_weight, next_eps):
    s, n = add_rms_norm_reference(x, residual, weight, eps, scale, next_weight, next_eps)
    q, qs = quantize_rows_reference(n)
    return s, q, qs


@add_rms_norm_quant.register_fake
def _(x, residual, weight, eps, scale, next_weight, next_eps):
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return (torch.empty(shape, dtype=x.dtype, device=x.device),
            torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(shape[:-1], dtype=torch.float32, device=x.device))


@add_rms_norm_quant.register_kernel("cuda")
def _(x, residual, weight, eps, scale, next_weight, next_eps):
    from gemma4opt.kernels.fp8_quant import add_rms_norm_quant_triton

    if x.shape != residual.shape:       # the kernel reads both as [rows, D]; keep broadcasting exact
        return add_rms_norm_quant_reference(x, residual, weight, eps, scale, next_weight, next_eps)
    return add_rms_norm_quant_triton(x, residual, weight, eps, scale, next_weight, next_eps)
