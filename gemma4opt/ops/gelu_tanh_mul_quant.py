"""gemma4opt::gelu_tanh_mul_quant — gemma4opt::gelu_tanh_mul, then FP8 per-row quantization, in one launch.

    (q, scales) = quantize_rows(gelu(gate, approximate="tanh") * up)   # the product in gate.dtype first

q: float8_e4m3fn of the broadcast shape; scales: fp32 of its leading dims (ops/fp8.py). Not used by
optimize() yet.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8 import quantize_rows_reference
from gemma4opt.ops.gelu_tanh_mul import gelu_tanh_mul_reference


@torch.library.custom_op("gemma4opt::gelu_tanh_mul_quant", mutates_args=())
def gelu_tanh_mul_quant(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gelu_tanh_mul_quant_reference(gate, up)


def gelu_tanh_mul_quant_reference(gate, up):
    return quantize_rows_reference(gelu_tanh_mul_reference(gate, up))


@gelu_tanh_mul_quant.register_fake
def _(gate, up):
    shape = torch.broadcast_shapes(gate.shape, up.shape)
    return (torch.empty(shape, dtype=torch.float8_e4m3fn, device=gate.device),
            torch.empty(shape[:-1], dtype=torch.float32, device=gate.device))


@gelu_tanh_mul_quant.register_kernel("cuda")
def _(gate, up):
    from gemma4opt.kernels.fp8_quant import gelu_tanh_mul_quant_triton

    if gate.shape != up.shape:            # broadcasting (PLE's gate): keep exact semantics
        return gelu_tanh_mul_quant_reference(gate, up)
    return gelu_tanh_mul_quant_triton(gate, up)
