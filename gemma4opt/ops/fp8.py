"""FP8 (e4m3) quantization references, vLLM's semantics: not an op, the oracle of the fp8 ops.

    weights:     one fp32 scale per output channel (row of W [N, K]) = row amax / 448
    activations: one fp32 scale per token (row), computed when quantized (dynamic)
    scale = max(amax / 448, SCALE_MIN)        # SCALE_MIN: an all-zero row quantizes to zeros
    q     = clamp(x.float() / scale, -448, 448).to(torch.float8_e4m3fn)
    y     = (x_q.float() * x_scale[:, None]) @ (w_q.float() * w_scale[:, None]).T  (fp32) -> out dtype

Every division is IEEE round-to-nearest (the Triton kernels use tl.math.div_rn, not Triton's
approximate fp32 ``/``), so a kernel that reaches the same fp32 value writes the same fp8 byte and
the same scale. The clamp only catches x / scale landing a rounding above 448 at the amax.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                             # torch.finfo(torch.float8_e4m3fn).max
SCALE_MIN = 1.0 / (FP8_MAX * 512.0)         # vLLM's minimum scaling factor


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 [..., D], fp32 scales [...]): one scale per row (per token)."""
    xf = x.float()
    if xf.shape[-1] == 0:
        amax = xf.new_zeros(xf.shape[:-1])
    else:
        amax = xf.abs().amax(-1)
    # A tensor divisor, not the Python float: CUDA divides by a CPU scalar as a multiply by its
    # reciprocal (an ulp off a / 448 in many rows); a tensor divisor is IEEE division on every device.
    scale = torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=SCALE_MIN)
    q = torch.clamp(xf / scale.unsqueeze(-1), -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def quantize_weight_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (fp8 [N, K], fp32 scales [N]): one scale per output channel."""
    if w.dim() != 2:
        raise ValueError(f"gemma4opt fp8: a weight is [N, K], got {tuple(w.shape)}")
    return quantize_rows_reference(w)


def dequantize_rows_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 q * scale per row (the inverse of quantize_rows_reference, up to fp8 rounding)."""
    return q.float() * scale.unsqueeze(-1)


def fp8_linear_reference(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor,
                         w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x_fp8 [..., K] with scales [...], W [N, K] with scales [N] -> [..., N] in out_dtype,
    dequantized and multiplied in fp32."""
    x = dequantize_rows_reference(x_fp8, x_scale)
    w = dequantize_rows_reference(w_fp8, w_scale)
    return torch.matmul(x, w.t()).to(out_dtype).contiguous()
