"""Triton residual tail: s = (residual + rmsnorm(x)*w1) [* scale]; n = rmsnorm(s)*w2 — one pass, two outputs.

Rounds to the activation dtype at the same points as HF's eager code (after each norm, the
add and the scale), so bf16 results track eager closely.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import dense, pdl_flags, pdl_prologue, row_launch, rows_view
from gemma4opt.kernels.rms_norm import inv_rms


@triton.jit
def add_rms_norm_row(X, R, W1, SCALE, W2, S, row, sx, sr, ss, cols, mask, D, eps1, eps2,
                     HAS_SCALE: tl.constexpr):
    """One row: s = residual + rms_norm(x, w1) (times scale), stored to S; returns the second
    norm rms_norm(s, w2) rounded to S's dtype, in fp32 (kernels/fp8_quant.py quantizes it)."""
    dt = S.dtype.element_ty
    # Every load first: at decode (one row, one program) the kernel is latency-bound, and a load
    # issued after a row reduction waits for it (4 dependent round trips otherwise, not 1).
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(W1 + cols, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(W2 + cols, mask=mask, other=0.0).to(tl.float32)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(SCALE).to(tl.float32)
    s = residual_sum(x, r, w1, inv_rms(x, D, eps1), scale, dt, HAS_SCALE)
    tl.store(S + row * ss + cols, s.to(dt), mask=mask)
    return (s * inv_rms(s, D, eps2) * w2).to(dt).to(tl.float32)


@triton.jit
def residual_sum(x, r, w1, inv1, scale, dt: tl.constexpr, HAS_SCALE: tl.constexpr):
    """s = r + rms_norm(x, w1) (times scale) in fp32, each step rounded to dt as HF's eager code
    rounds it, given x's norm factor inv1 (kernels/norm_linear.py makes it tile by tile too)."""
    s = (r + (x * inv1 * w1).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    if HAS_SCALE:
        s = (s * scale).to(dt).to(tl.float32)
    return s


@triton.jit
def _add_rms_norm_kernel(X, R, W1, SCALE, W2, S, N, sx, sr, ss, sn, D, eps1, eps2,
                         HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    n = add_rms_norm_row(X, R, W1, SCALE, W2, S, row, sx, sr, ss, cols, mask, D, eps1, eps2, HAS_SCALE)
    tl.store(N + row * sn + cols, n.to(N.dtype.element_ty), mask=mask)


def add_rms_norm_triton(x, residual, weight, eps, scale, next_weight, next_eps):
    D = x.shape[-1]
    x2, r2 = rows_view(x), rows_view(residual)
    weight, scale, next_weight = dense(weight, scale, next_weight)
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = torch.empty_like(s)
    if s.shape[0]:
        block, warps = row_launch(D, s.shape[0])
        _add_rms_norm_kernel[(s.shape[0],)](
            x2, r2, weight, scale if scale is not None else weight, next_weight, s, n,
            x2.stride(0), r2.stride(0), s.stride(0), n.stride(0), D, eps, next_eps,
            HAS_SCALE=scale is not None, BLOCK=block, num_warps=warps, **pdl_flags(s),
        )
    return s.view(x.shape), n.view(x.shape)
