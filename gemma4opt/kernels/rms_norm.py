"""Triton RMSNorm: one program per row, the whole row in registers (D <= 16384)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import dense, pdl_flags, pdl_prologue, row_launch, rows_view


@triton.jit
def inv_rms(x, D, eps):
    """1 / sqrt(mean(x^2) + eps) of an fp32 row whose masked lanes are 0: every gemma4opt norm's
    scale, computed the same way in each kernel that normalizes a row."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, D, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:      # loaded before the reduction, so both loads are in flight at once
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * inv_rms(x, D, eps)
    if HAS_WEIGHT:
        y = y * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    D = x.shape[-1]
    x2, weight = rows_view(x), dense(weight)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block, warps = row_launch(D, rows)
        _rms_norm_kernel[(rows,)](
            x2, weight if weight is not None else x2, y, x2.stride(0), y.stride(0), D, eps,
            HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=warps, **pdl_flags(x2),
        )
    return y.view(x.shape)
