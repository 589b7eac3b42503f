"""Triton per-head RMSNorm (q_norm/k_norm) + rotate_half RoPE in one pass.

x: [B, S, H, D] (any strides with unit stride on D), cos/sin: [B, S, 1, D] broadcast over heads.
Proportional RoPE (full layers, partial rotary 0.25) is the same math: HF zero-pads inv_freq, so
cos=1, sin=0 on the unrotated dims. Output is contiguous [B, S, H, D].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_rope_kernel(X, W, C, Sn, O, H, S, sxb, sxs, sxh, scb, scs, ssb, sss, D, HALF, eps,
                          BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)       # one program per (b, s, h)
    h = pid % H
    bs = pid // H
    s = bs % S
    b = bs // S
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    dt = O.dtype.element_ty
    xb = X + b * sxb + s * sxs + h * sxh
    x1 = tl.load(xb + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    y1 = (x1 * inv * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    y2 = (x2 * inv * tl.load(W + HALF + cols, mask=mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    cb = C + b * scb + s * scs
    sb = Sn + b * ssb + s * sss
    c1 = tl.load(cb + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cb + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sb + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sb + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    ob = O + pid * D
    tl.store(ob + cols, (y1 * c1 - y2 * s1).to(dt), mask=mask)
    tl.store(ob + HALF + cols, (y2 * c2 + y1 * s2).to(dt), mask=mask)


def rms_norm_rope_triton(x, weight, cos, sin, eps):
    B, S, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos.expand(B, S, 1, D)
    sin = sin.expand(B, S, 1, D)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    out = torch.empty((B, S, H, D), dtype=x.dtype, device=x.device)
    if out.numel():
        half = D // 2
        block = triton.next_power_of_2(half)
        _rms_norm_rope_kernel[(B * S * H,)](
            x, weight, cos, sin, out, H, S, x.stride(0), x.stride(1), x.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), D, half, eps,
            BLOCK=block, num_warps=4 if block <= 256 else 8,
        )
    return out
