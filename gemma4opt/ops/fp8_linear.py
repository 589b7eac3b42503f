"""gemma4opt::fp8_linear — an FP8 (e4m3) projection with per-token and per-channel scales.

    y = (x_fp8.float() * x_scale[..., None]) @ (w_fp8.float() * w_scale[:, None]).T   (fp32) -> out_dtype
    y = tanh(y / cap) * cap                                   (cap > 0 only: an fp8 lm_head's softcap)

x_fp8 [..., K] with fp32 x_scale [...] (one per token: ops/fp8.py's quantize_rows, or the fused
*_quant ops), w_fp8 [N, K] with fp32 w_scale [N] (one per output channel: quantize_weight). The CPU
path is the reference. On CUDA: torch._scaled_mm with row-wise scales (scale_a [rows, 1], scale_b
[1, N]; it takes a bf16 output and K, N multiples of 16), except that up to ``MAX_ROWS`` rows
(decode) each shape (rows, N, K, out dtype) runs kernels/fp8_linear.py's skinny Triton GEMM when it
was faster on that shape's first call, timed as a decode step runs it (ops/pick.py's
time_in_graph, as ops/linear.py against cuBLAS); where _scaled_mm cannot run, the Triton GEMM, and above 32 rows the
reference. Optimize(quantization="fp8") uses it for every quantized projection.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8 import fp8_linear_reference
from gemma4opt.ops.pick import check_then_time
from gemma4opt.ops.state import picks_api, picks_for

MAX_ROWS = 32


picks, failures = picks_api("fp8_linear")


@torch.library.custom_op("gemma4opt::fp8_linear", mutates_args=())
def fp8_linear(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype, cap: float = 0.0) -> torch.Tensor:
    return softcapped(fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, out_dtype), cap)


def softcapped(y: torch.Tensor, cap: float) -> torch.Tensor:
    """With cap > 0 (an fp8 lm_head, patterns/logit_softcap.py), HF's final-logit softcap on the
    GEMM's output in its dtype, as HF's eager code computes it (/, tanh, *)."""
    return torch.tanh(y / cap) * cap if cap else y


@fp8_linear.register_fake
def _(x_fp8, x_scale, w_fp8, w_scale, out_dtype, cap=0.0):
    return torch.empty((*x_fp8.shape[:-1], w_fp8.shape[0]), dtype=out_dtype, device=x_fp8.device)


def triton_fits(x_fp8, w_fp8) -> bool:
    """Whether the skinny Triton GEMM can take this call: decode rows and unit-stride weight rows."""
    rows = x_fp8.numel() // max(x_fp8.shape[-1], 1)
    return 0 < rows <= MAX_ROWS and w_fp8.stride(-1) == 1


def _time_both(x_fp8, x_scale, w_fp8, w_scale, out_dtype) -> tuple[float, float]:
    from gemma4opt.kernels.fp8_linear import fp8_linear_triton

    return check_then_time(lambda w: fp8_linear_triton(x_fp8, x_scale, w, w_scale, out_dtype),
                           lambda w: scaled_mm(x_fp8, x_scale, w, w_scale, out_dtype), w_fp8,
                           "skinny fp8 Triton GEMM", "torch._scaled_mm")


def runs_triton(x_fp8, w_fp8, x_scale=None, w_scale=None, out_dtype=torch.bfloat16) -> bool:
    """Whether this CUDA call runs the skinny Triton GEMM: it fits, and _scaled_mm cannot run the
    call or the active model's pick for the shape is Triton (timed now if new)."""
    if not triton_fits(x_fp8, w_fp8):
        return False
    if not runs_scaled_mm(x_fp8, w_fp8, out_dtype) or x_scale is None:
        return True
    rows = x_fp8.numel() // x_fp8.shape[-1]
    key = (rows, w_fp8.shape[0], w_fp8.shape[1], out_dtype, x_fp8.device.index)
    return picks_for("fp8_linear").pick(key, lambda: _time_both(x_fp8, x_scale, w_fp8, w_scale, out_dtype))


def runs_scaled_mm(x_fp8, w_fp8, out_dtype) -> bool:
    """Whether torch._scaled_mm's row-wise scaling takes this call (bf16 out, K and N multiples of 16)."""
    K, N = x_fp8.shape[-1], w_fp8.shape[0]
    return out_dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0 and x_fp8.numel() > 0 and N > 0


def scaled_mm(x_fp8, x_scale, w_fp8, w_scale, out_dtype):
    """torch._scaled_mm with one scale per row of x and per row of W (W^T column-major, as it needs)."""
    K, N = x_fp8.shape[-1], w_fp8.shape[0]
    # cuBLASLt refuses (NOT_SUPPORTED) operands and scales that do not start on 16 bytes: the last
    # row of a prefill (logits_to_keep=1) is a view into its quantized rows and their scales.
    x2 = _aligned(x_fp8.reshape(-1, K).contiguous())
    y = torch._scaled_mm(x2, w_fp8.contiguous().t(), scale_a=_aligned(x_scale.reshape(-1, 1).float().contiguous()),
                         scale_b=_aligned(w_scale.reshape(1, N).float().contiguous()), out_dtype=out_dtype)
    return y.view(*x_fp8.shape[:-1], N)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % 16 == 0 else t.clone()


@fp8_linear.register_kernel("cuda")
def _(x_fp8, x_scale, w_fp8, w_scale, out_dtype, cap=0.0):
    if runs_triton(x_fp8, w_fp8, x_scale, w_scale, out_dtype):
        from gemma4opt.kernels.fp8_linear import fp8_linear_triton

        return fp8_linear_triton(x_fp8, x_scale, w_fp8, w_scale, out_dtype, cap=cap)
    if runs_scaled_mm(x_fp8, w_fp8, out_dtype):
        y = scaled_mm(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
        if cap:
            from gemma4opt.kernels.softcap import softcap_

            y = softcap_(y.contiguous(), cap)
        return y
    return softcapped(fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, out_dtype), cap)
