"""gemma4opt::norm_add — a normed branch added to another tensor, in one op with no next norm.

    s = rms_norm(x, weight, eps) + (rms_norm(y, y_weight, y_eps) if norm_y else y)

Two tails of Gemma-4's layers that the residual tail (gemma4opt::add_rms_norm) cannot take,
because no norm of the sum follows in the same place:
- with per-layer inputs (e2b, e4b): the post-feedforward tail ``residual + post_ff_norm(mlp)``,
  whose sum feeds the PLE gate GEMM (norm_y=False, y = the residual);
- with MoE (26b-a4b): ``post_ff_norm_1(mlp) + post_ff_norm_2(experts)``, whose sum is the next
  norm's input (norm_y=True).
Each unfused is two or three launches of latency-bound row kernels at decode.

Rounded where HF's eager code rounds: each norm's output, then the sum, in the activation dtype.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.rms_norm import rms_norm_reference


@torch.library.custom_op("gemma4opt::norm_add", mutates_args=())
def norm_add(x: torch.Tensor, weight: torch.Tensor, eps: float, y: torch.Tensor, y_weight: torch.Tensor | None,
             y_eps: float, norm_y: bool) -> torch.Tensor:
    return norm_add_reference(x, weight, eps, y, y_weight, y_eps, norm_y)


def norm_add_reference(x, weight, eps, y, y_weight, y_eps, norm_y):
    other = rms_norm_reference(y, y_weight, y_eps) if norm_y else y
    return (rms_norm_reference(x, weight, eps) + other).contiguous()


@norm_add.register_fake
def _(x, weight, eps, y, y_weight, y_eps, norm_y):
    return torch.empty(torch.broadcast_shapes(x.shape, y.shape), dtype=x.dtype, device=x.device)


@norm_add.register_kernel("cuda")
def _(x, weight, eps, y, y_weight, y_eps, norm_y):
    from gemma4opt.kernels.norm_add import norm_add_triton

    if x.shape != y.shape or x.dtype != y.dtype:   # broadcasting or mixed dtypes: not a decoder tail
        return norm_add_reference(x, weight, eps, y, y_weight, y_eps, norm_y)
    return norm_add_triton(x, weight, eps, y, y_weight, y_eps, norm_y)
