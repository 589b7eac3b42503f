"""gemma4opt::moe_router — Gemma-4 MoE router, one op.

    h = rms_norm(x, None, eps) * scale * root           # root = hidden_size ** -0.5
    probs = softmax(linear(h, proj_weight), fp32)
    w, idx = topk(probs, k); w = w / w.sum(-1) * per_expert_scale[idx]
    return probs, w, idx

gemma4opt::moe_router_norm also returns the experts' input norm of the same x,
``rms_norm(x, norm_weight, norm_eps)`` (pre_feedforward_layernorm_2): on CUDA one kernel reads the
row once for both norms, where they were two launches.
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


def _route_cuda(x, scale, proj_weight, per_expert_scale, eps, root, top_k, norm_weight=None, norm_eps=0.0):
    """Both ops on CUDA: the router's input (and, with ``norm_weight``, the experts' norm) from one
    kernel where the dtypes agree (mixed dtypes promote in torch's ops: those run instead), the
    GEMM, then the softmax / top-k kernel; decode rows all of it in one kernel
    (kernels/moe_router_decode.py). Returns (probs, w, idx[, n])."""
    from gemma4opt.kernels.moe_router import router_input_triton, router_topk_triton
    from gemma4opt.kernels.moe_router_decode import router_decode_supported, router_decode_triton

    if router_decode_supported(x, scale, proj_weight, top_k, norm_weight):
        return router_decode_triton(x, scale, proj_weight, per_expert_scale, eps, root, top_k, norm_weight, norm_eps)
    weights = [scale] + ([norm_weight] if norm_weight is not None else [])
    if all(w.dtype == x.dtype and w.dim() == 1 for w in weights):
        out = router_input_triton(x, scale, eps, root, norm_weight, norm_eps)
        h, extra = (out, ()) if norm_weight is None else (out[0], (out[1],))
    else:
        h = _router_input(x, scale, eps, root)
        extra = () if norm_weight is None else (rms_norm_reference(x, norm_weight, norm_eps),)
    return (*router_topk_triton(F.linear(h, proj_weight), per_expert_scale, top_k), *extra)


@moe_router.register_kernel("cuda")
def _(x, scale, proj_weight, per_expert_scale, eps, root, top_k):
    return _route_cuda(x, scale, proj_weight, per_expert_scale, eps, root, top_k)


@torch.library.custom_op("gemma4opt::moe_router_norm", mutates_args=())
def moe_router_norm(x: torch.Tensor, scale: torch.Tensor, proj_weight: torch.Tensor, per_expert_scale: torch.Tensor,
                    eps: float, root: float, top_k: int, norm_weight: torch.Tensor, norm_eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    probs, w, idx = moe_router_reference(x, scale, proj_weight, per_expert_scale, eps, root, top_k)
    return probs, w, idx, rms_norm_reference(x, norm_weight, norm_eps)


@moe_router_norm.register_fake
def _(x, scale, proj_weight, per_expert_scale, eps, root, top_k, norm_weight, norm_eps):
    probs = x.new_empty((x.shape[0], proj_weight.shape[0]), dtype=torch.float32)
    return (probs, x.new_empty((x.shape[0], top_k), dtype=torch.float32),
            x.new_empty((x.shape[0], top_k), dtype=torch.int64), torch.empty_like(x))


@moe_router_norm.register_kernel("cuda")
def _(x, scale, proj_weight, per_expert_scale, eps, root, top_k, norm_weight, norm_eps):
    return _route_cuda(x, scale, proj_weight, per_expert_scale, eps, root, top_k, norm_weight, norm_eps)
