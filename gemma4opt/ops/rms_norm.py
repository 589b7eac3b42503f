"""gemma4opt::rms_norm — Gemma-4 RMSNorm (weight without +1 offset; optional weight).

    y = (x.float() * (mean(x.float()**2, -1) + eps) ** -0.5 * weight.float()).to(x.dtype)
"""
from __future__ import annotations

import torch


@torch.library.custom_op("gemma4opt::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF Gemma4RMSNorm.forward, op for op (the CPU path and the test oracle)."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x).contiguous()


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@rms_norm.register_kernel("cuda")
def _(x, weight, eps):
    from gemma4opt.kernels.rms_norm import rms_norm_triton

    return rms_norm_triton(x, weight, eps)
