"""gemma4opt::add_rms_norm — a residual tail and the next norm in one op, two outputs.

    s = residual + rms_norm(x, weight, eps)
    s = s * scale                      # layer_scalar at a layer's end; absent mid-layer
    n = rms_norm(s, next_weight, next_eps)
    return s, n                        # s: the new residual stream, n: the next block's input
"""
from __future__ import annotations

import torch

from gemma4opt.ops.rms_norm import rms_norm_reference


@torch.library.custom_op("gemma4opt::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 scale: torch.Tensor | None, next_weight: torch.Tensor, next_eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_reference(x, residual, weight, eps, scale, next_weight, next_eps)


def add_rms_norm_reference(x, residual, weight, eps, scale, next_weight, next_eps):
    s = residual + rms_norm_reference(x, weight, eps)
    if scale is not None:
        s = s * scale
    return s.contiguous(), rms_norm_reference(s, next_weight, next_eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps, scale, next_weight, next_eps):
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return (torch.empty(shape, dtype=x.dtype, device=x.device),
            torch.empty(shape, dtype=x.dtype, device=x.device))


@add_rms_norm.register_kernel("cuda")
def _(x, residual, weight, eps, scale, next_weight, next_eps):
    from gemma4opt.kernels.add_rms_norm import add_rms_norm_triton

    return add_rms_norm_triton(x, residual, weight, eps, scale, next_weight, next_eps)
