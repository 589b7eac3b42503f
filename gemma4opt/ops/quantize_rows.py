"""gemma4opt::quantize_rows — FP8 (e4m3) per-row (per-token) quantization on its own.

    (q, scales) = quantize_rows(x)      # ops/fp8.py's semantics

For a GEMM input that no gemma4opt kernel produces (the attention output before o_proj); the
inputs that rms_norm, the residual tail or gelu_tanh_mul produce are quantized inside those
kernels (the *_quant ops; patterns/fp8_quant.py pairs them).
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8 import FP8_DTYPE, quantize_rows_reference


@torch.library.custom_op("gemma4opt::quantize_rows", mutates_args=())
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows_reference(x)


@quantize_rows.register_fake
def _(x):
    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


@quantize_rows.register_kernel("cuda")
def _(x):
    from gemma4opt.kernels.fp8_quant import quantize_rows_triton

    return quantize_rows_triton(x)
