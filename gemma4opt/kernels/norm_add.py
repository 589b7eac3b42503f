"""Triton s = rms_norm(x) * w (+ rms_norm(y) * w_y, or + y): one pass over a row, one output
(ops/norm_add.py states the semantics). Rounds to the activation dtype at the same points as
HF's eager code: each norm's output, then the sum."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import dense, pdl_flags, pdl_prologue, row_launch, rows_view
from gemma4opt.kernels.rms_norm import inv_rms


@triton.jit
def _norm_add_kernel(X, W, Y, WY, S, sx, sy, ss, D, eps, eps_y, NORM_Y: tl.constexpr, Y_WEIGHT: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dt = S.dtype.element_ty
    # Every load before the first reduction (a decode row is one latency-bound program).
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + row * sy + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if Y_WEIGHT:
        wy = tl.load(WY + cols, mask=mask, other=0.0).to(tl.float32)
    nx = (x * inv_rms(x, D, eps) * w).to(dt).to(tl.float32)
    if NORM_Y:
        y = y * inv_rms(y, D, eps_y)
        if Y_WEIGHT:
            y = y * wy
        y = y.to(dt).to(tl.float32)
    tl.store(S + row * ss + cols, (nx + y).to(dt), mask=mask)


def norm_add_triton(x, weight, eps, y, y_weight, y_eps, norm_y):
    """x, y of one shape and dtype -> rms_norm(x, weight) + (rms_norm(y, y_weight) if norm_y else y)."""
    D = x.shape[-1]
    x2, y2 = rows_view(x), rows_view(y)
    weight, y_weight = dense(weight, y_weight)
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if s.shape[0]:
        block, warps = row_launch(D, s.shape[0])
        has_wy = bool(norm_y) and y_weight is not None
        _norm_add_kernel[(s.shape[0],)](
            x2, weight, y2, y_weight if has_wy else weight, s, x2.stride(0), y2.stride(0), s.stride(0), D, eps, y_eps,
            NORM_Y=bool(norm_y), Y_WEIGHT=has_wy, BLOCK=block, num_warps=warps, **pdl_flags(s),
        )
    return s.view(x.shape)
