"""gemma4opt::rms_norm_quant — rms_norm, then FP8 per-row quantization, in one launch.

    (q, scales) = quantize_rows(rms_norm(x, weight, eps))    # the norm rounded to x.dtype first

q: float8_e4m3fn like x; scales: fp32 x.shape[:-1] (ops/fp8.py).
patterns/fp8_quant.py puts it where a norm feeds an fp8 GEMM (quantization="fp8").
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8 import quantize_rows_reference
from gemma4opt.ops.rms_norm import rms_norm_reference


@torch.library.custom_op("gemma4opt::rms_norm_quant", mutates_args=())
def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_quant_reference(x, weight, eps)


def rms_norm_quant_reference(x, weight, eps):
    return quantize_rows_reference(rms_norm_reference(x, weight, eps))


@rms_norm_quant.register_fake
def _(x, weight, eps):
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


@rms_norm_quant.register_kernel("cuda")
def _(x, weight, eps):
    from gemma4opt.kernels.fp8_quant import rms_norm_quant_triton

    return rms_norm_quant_triton(x, weight, eps)
