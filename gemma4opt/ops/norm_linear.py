"""gemma4opt::norm_linear — a residual tail and the GEMM that reads it, one op, two outputs:

    s, n = gemma4opt.add_rms_norm(x, residual, weight, eps, scale, next_weight, next_eps)
    y = gemma4opt.linear(n, W)                 # a layer's end, then the next layer's q/k/v

    s = gemma4opt.norm_add(x, weight, eps, residual, None, _, False)       # next_weight=None
    y = gemma4opt.linear(s, W)                 # an MLP's end, then the per-layer-input gate

    return s, y                                # s: the new residual stream

On CUDA at one row (batch-1 decode), K <= kernels/norm_linear.py's MAX_K, each shape runs whichever
was faster when both were timed as a decode step runs them (ops/pick.py's time_in_graph), on its
first call, and only if both outputs matched: the skinny GEMM making the tail as it reads its
input (kernels/norm_linear.py, one launch) or the two ops above (two launches, the GEMM its own
pick). More rows and CPU: the two ops.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.pick import check_close, check_then_time
from gemma4opt.ops.state import picks_api, picks_for

picks, failures = picks_api("norm_linear")


@torch.library.custom_op("gemma4opt::norm_linear", mutates_args=())
def norm_linear(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                scale: torch.Tensor | None, next_weight: torch.Tensor | None, next_eps: float,
                w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_linear_reference(x, residual, weight, eps, scale, next_weight, next_eps, w)


def norm_linear_reference(x, residual, weight, eps, scale, next_weight, next_eps, w):
    """The ops it replaced, as the unfused graph calls them."""
    if next_weight is None:
        s = torch.ops.gemma4opt.norm_add(x, weight, eps, residual, None, next_eps, False)
        return s, torch.ops.gemma4opt.linear(s, w)
    s, n = torch.ops.gemma4opt.add_rms_norm(x, residual, weight, eps, scale, next_weight, next_eps)
    return s, torch.ops.gemma4opt.linear(n, w)


@norm_linear.register_fake
def _(x, residual, weight, eps, scale, next_weight, next_eps, w):
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return x.new_empty(shape), x.new_empty((*shape[:-1], w.shape[0]))


def _time_both(x, residual, weight, eps, scale, next_weight, next_eps, w) -> tuple[float, float]:
    from gemma4opt.kernels.norm_linear import norm_linear_triton

    args = (x, residual, weight, eps, scale, next_weight, next_eps)
    check_close(norm_linear_triton(*args, w)[0], norm_linear_reference(*args, w)[0],
                what="the GEMM's residual tail", other="the residual tail kernel")
    return check_then_time(lambda wt: norm_linear_triton(*args, wt)[1], lambda wt: norm_linear_reference(*args, wt)[1],
                           w, "skinny GEMM making the residual tail", "the tail kernel + gemma4opt.linear")


def runs_triton(x, residual, weight, eps, scale, next_weight, next_eps, w) -> bool:
    """Whether this CUDA call runs the fused GEMM: one row, x and residual of one shape, a shape the
    kernel takes (kernels/norm_linear.py ``supported``) and the active model's picks give to it
    (timed now if new)."""
    from gemma4opt.kernels.norm_linear import supported

    if residual.shape != x.shape or residual.dtype != x.dtype or supported(x, w) is not None:
        return False
    key = (1, w.shape[0], w.shape[1], next_weight is not None, scale is not None, x.dtype, x.device.index)
    return picks_for("norm_linear").pick(
        key, lambda: _time_both(x, residual, weight, eps, scale, next_weight, next_eps, w))


@norm_linear.register_kernel("cuda")
def _(x, residual, weight, eps, scale, next_weight, next_eps, w):
    args = (x, residual, weight, eps, scale, next_weight, next_eps, w)
    if runs_triton(*args):
        from gemma4opt.kernels.norm_linear import norm_linear_triton

        return norm_linear_triton(*args)
    return norm_linear_reference(*args)
