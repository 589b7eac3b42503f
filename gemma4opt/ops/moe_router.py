"""gemma4opt::moe_router — Gemma-4 MoE router, one op.

    h = rms_norm(x, None, eps) * scale * root           # root = hidden_size ** -0.5
    probs = softmax(linear(h, proj_weight), fp32)
    w, idx = topk(probs, k); w = w / w.sum(-1) * per_expert_scale[idx]
    return probs, w, idx
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gemma4opt.ops.rms_norm import rms_norm_reference


@torch.library.custom_op("gemma4opt::moe_router", mutates_args=())
def moe_router(x: torch.Tensor, scale: torch.Tensor, proj_weight: torch.Tensor, per_expert_scale: torch.Tensor,
               eps: float, root: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return moe_router_reference(x, scale, proj_weight, per_expert_scale, eps, root, top_k)


def _router_input(x, scale, eps, root):
    return rms_norm_reference(x, None, eps) * scale * root


def moe_router_reference(x, scale, proj_weight, per_expert_scale, eps, root, top_k):
    scores = F.linear(_router_input(x, scale, eps, root), proj_weight)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, k=top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return probs, w * per_expert_scale[idx], idx


@moe_router.register_fake
def _(x, scale, proj_weight, per_expert_scale, eps, root, top_k):
    T, E = x.shape[0], proj_weight.shape[0]
    return (x.new_empty((T, E), dtype=torch.float32), x.new_empty((T, top_k), dtype=torch.float32),
            x.new_empty((T, top_k), dtype=torch.int64))


@moe_router.register_kernel("cuda")
def _(x, scale, proj_weight, per_expert_scale, eps, root, top_k):
    from gemma4opt.kernels.moe_router import router_input_triton, router_topk_triton

    if scale.dtype == x.dtype and scale.dim() == 1:     # one kernel for the norm and both multiplies
        h = router_input_triton(x, scale, eps, root)
    else:                                               # mixed dtypes promote: torch's own ops
        h = _router_input(x, scale, eps, root)
    return router_topk_triton(F.linear(h, proj_weight), per_expert_scale, top_k)
