"""gemma4opt::rms_norm_rope — per-head q_norm/k_norm followed by rotate_half RoPE.

    y = rms_norm(x, weight, eps)                   # x: [B, S, H, D]
    out = y * cos + cat(-y[..., D/2:], y[..., :D/2]) * sin      # cos/sin: [B, S, 1, D]
"""
from __future__ import annotations

import torch


@torch.library.custom_op("gemma4opt::rms_norm_rope", mutates_args=())
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float) -> torch.Tensor:
    return rms_norm_rope_reference(x, weight, cos, sin, eps)


def rms_norm_rope_reference(x, weight, cos, sin, eps):
    from gemma4opt.ops.rms_norm import rms_norm_reference

    y = rms_norm_reference(x, weight, eps)
    half = y.shape[-1] // 2
    rotated = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    return (y * cos + rotated * sin).contiguous()


@rms_norm_rope.register_fake
def _(x, weight, cos, sin, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@rms_norm_rope.register_kernel("cuda")
def _(x, weight, cos, sin, eps):
    from gemma4opt.kernels.rms_norm_rope import rms_norm_rope_triton

    return rms_norm_rope_triton(x, weight, cos, sin, eps)
