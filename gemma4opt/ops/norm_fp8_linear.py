"""gemma4opt::norm_fp8_linear — ops/norm_linear.py's op with fp8 weights (quantization="fp8"): a
layer's end, its norm quantized per row, and the next layer's fp8 q/k/v, one op, two outputs:

    s, q, x_scale = gemma4opt.add_rms_norm_quant(x, residual, weight, eps, scale, next_weight, next_eps)
    y = gemma4opt.fp8_linear(q, x_scale, W_fp8, w_scale, out_dtype)
    return s, y

On CUDA at one row, K <= kernels/norm_linear.py's MAX_K, each shape runs whichever was faster when both were timed as a decode
step runs them, on its first call, and only if both outputs matched: the fp8 skinny GEMM making and
quantizing the tail as it reads its input (kernels/norm_fp8_linear.py, one launch) or the two ops
above. More rows and CPU: the two ops.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.pick import check_close, check_then_time
from gemma4opt.ops.state import picks_api, picks_for

picks, failures = picks_api("norm_fp8_linear")


@torch.library.custom_op("gemma4opt::norm_fp8_linear", mutates_args=())
def norm_fp8_linear(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    scale: torch.Tensor | None, next_weight: torch.Tensor, next_eps: float, w_fp8: torch.Tensor,
                    w_scale: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_fp8_linear_reference(x, residual, weight, eps, scale, next_weight, next_eps, w_fp8, w_scale, out_dtype)


def norm_fp8_linear_reference(x, residual, weight, eps, scale, next_weight, next_eps, w_fp8, w_scale, out_dtype):
    """The ops it replaced, as the unfused graph calls them."""
    s, q, qs = torch.ops.gemma4opt.add_rms_norm_quant(x, residual, weight, eps, scale, next_weight, next_eps)
    return s, torch.ops.gemma4opt.fp8_linear(q, qs, w_fp8, w_scale, out_dtype)


@norm_fp8_linear.register_fake
def _(x, residual, weight, eps, scale, next_weight, next_eps, w_fp8, w_scale, out_dtype):
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return x.new_empty(shape), x.new_empty((*shape[:-1], w_fp8.shape[0]), dtype=out_dtype)


def _time_both(args, w_fp8, w_scale, out_dtype) -> tuple[float, float]:
    from gemma4opt.kernels.norm_fp8_linear import norm_fp8_linear_triton

    check_close(norm_fp8_linear_triton(*args, w_fp8, w_scale, out_dtype)[0],
                norm_fp8_linear_reference(*args, w_fp8, w_scale, out_dtype)[0],
                what="the fp8 GEMM's residual tail", other="the residual tail kernel")
    return check_then_time(lambda wt: norm_fp8_linear_triton(*args, wt, w_scale, out_dtype)[1],
                           lambda wt: norm_fp8_linear_reference(*args, wt, w_scale, out_dtype)[1], w_fp8,
                           "fp8 skinny GEMM quantizing the residual tail", "add_rms_norm_quant + gemma4opt.fp8_linear")


@norm_fp8_linear.register_kernel("cuda")
def _(x, residual, weight, eps, scale, next_weight, next_eps, w_fp8, w_scale, out_dtype):
    from gemma4opt.kernels.norm_fp8_linear import norm_fp8_linear_triton, supported

    args = (x, residual, weight, eps, scale, next_weight, next_eps)
    key = (1, w_fp8.shape[0], w_fp8.shape[1], scale is not None, x.dtype, x.device.index)
    if (residual.shape == x.shape and residual.dtype == x.dtype and supported(x, w_fp8, out_dtype) is None
            and picks_for("norm_fp8_linear").pick(key, lambda: _time_both(args, w_fp8, w_scale, out_dtype))):
        return norm_fp8_linear_triton(*args, w_fp8, w_scale, out_dtype)
    return norm_fp8_linear_reference(*args, w_fp8, w_scale, out_dtype)
