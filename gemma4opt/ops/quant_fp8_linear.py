"""gemma4opt::quant_fp8_linear — an fp8 GEMM whose input's per-token quantization it does itself:

    q, x_scale = gemma4opt.quantize_rows(x)                    # ops/fp8.py's semantics
    y = gemma4opt.fp8_linear(q, x_scale, W_fp8, w_scale, out_dtype)

For a GEMM input that no gemma4opt kernel produces (the attention output before o_proj) and for the
MLP's down GEMM after its fused gate/up GEMV (ops/gelu_linear.py): at decode the quantize kernel is
a launch of its own (~2 µs at one e4b row on an H100, profile_e4b_fp8_nopdl_h100.txt) before a GEMM
of ~4 µs. On CUDA with at most 32 rows each shape runs whichever was faster when both were timed as
a decode step runs them, on its first call, and only if their results matched: the fp8 skinny GEMM
taking the rows' scales from a pass over x and quantizing each tile as it reads it (the bytes
quantize_rows writes; kernels/fp8_linear.py, QUANT) or the two ops above. More rows and CPU: the two ops.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.pick import check_then_time
from gemma4opt.ops.state import picks_api, picks_for

MAX_ROWS = 32

picks, failures = picks_api("quant_fp8_linear")


@torch.library.custom_op("gemma4opt::quant_fp8_linear", mutates_args=())
def quant_fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    return quant_fp8_linear_reference(x, w_fp8, w_scale, out_dtype)


def quant_fp8_linear_reference(x, w_fp8, w_scale, out_dtype):
    """The ops it replaced, as the unfused graph calls them."""
    q, s = torch.ops.gemma4opt.quantize_rows(x)
    return torch.ops.gemma4opt.fp8_linear(q, s, w_fp8, w_scale, out_dtype)


@quant_fp8_linear.register_fake
def _(x, w_fp8, w_scale, out_dtype):
    return x.new_empty((*x.shape[:-1], w_fp8.shape[0]), dtype=out_dtype)


def _time_both(x, w_fp8, w_scale, out_dtype) -> tuple[float, float]:
    from gemma4opt.kernels.fp8_linear import quant_fp8_linear_triton

    return check_then_time(lambda w: quant_fp8_linear_triton(x, w, w_scale, out_dtype),
                           lambda w: quant_fp8_linear_reference(x, w, w_scale, out_dtype), w_fp8,
                           "fp8 skinny GEMM quantizing its input", "quantize_rows + gemma4opt.fp8_linear")


def runs_triton(x, w_fp8, w_scale, out_dtype) -> bool:
    """Whether this CUDA call runs the quantizing GEMM: decode rows, a 16-bit input, unit-stride e4m3
    weight rows, and a shape the active model's picks give to it (timed now if new)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not (0 < rows <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and w_fp8.stride(-1) == 1
            and w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape[-1] == x.shape[-1]):
        return False
    key = (rows, w_fp8.shape[0], w_fp8.shape[1], x.dtype, out_dtype, x.device.index)
    return picks_for("quant_fp8_linear").pick(key, lambda: _time_both(x, w_fp8, w_scale, out_dtype))


@quant_fp8_linear.register_kernel("cuda")
def _(x, w_fp8, w_scale, out_dtype):
    if runs_triton(x, w_fp8, w_scale, out_dtype):
        from gemma4opt.kernels.fp8_linear import quant_fp8_linear_triton

        return quant_fp8_linear_triton(x, w_fp8, w_scale, out_dtype)
    return quant_fp8_linear_reference(x, w_fp8, w_scale, out_dtype)
