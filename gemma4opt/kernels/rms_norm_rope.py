"""Triton per-head RMSNorm (q_norm/k_norm) + rotate_half RoPE in one pass.

x: [B, S, H, D] (any strides with unit stride on D), cos/sin: [B or 1, S, 1, D] broadcast over
heads. Proportional RoPE (full layers, partial rotary 0.25) is the same math: HF zero-pads
inv_freq, so cos=1, sin=0 on the unrotated dims. Output is contiguous [B, S, H, D].

One program handles a block of heads of one token, so cos/sin are read once per block rather
than once per head (per head they would cost as much traffic as x itself).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_rope_kernel(X, W, C, Sn, O, H, S, sxb, sxs, sxh, scb, scs, ssb, sss, D, HALF, eps,
                          HB: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)          # b * S + s
    hblk = tl.program_id(1)
    s = tok % S
    b = tok // S
    heads = hblk * HB + tl.arange(0, HB)
    cols = tl.arange(0, BLOCK)
    hmask = heads < H
    cmask = cols < HALF
    mask = hmask[:, None] & cmask[None, :]
    dt = O.dtype.element_ty
    xp = X + b * sxb + s * sxs + heads[:, None].to(tl.int64) * sxh + cols[None, :]
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
    w1 = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.load(W + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    y1 = (x1 * inv[:, None] * w1[None, :]).to(dt).to(tl.float32)       # HF rounds the norm's output
    y2 = (x2 * inv[:, None] * w2[None, :]).to(dt).to(tl.float32)
    cb = C + b * scb + s * scs
    sb = Sn + b * ssb + s * sss
    c1 = tl.load(cb + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cb + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sb + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sb + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    op = O + (tok * H + heads[:, None].to(tl.int64)) * D + cols[None, :]
    tl.store(op, (y1 * c1 - y2 * s1).to(dt), mask=mask)
    tl.store(op + HALF, (y2 * c2 + y1 * s2).to(dt), mask=mask)


def rms_norm_rope_triton(x, weight, cos, sin, eps):
    B, S, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.expand(B, S, 1, D), sin.expand(B, S, 1, D)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    out = torch.empty((B, S, H, D), dtype=x.dtype, device=x.device)
    if out.numel():
        half = D // 2
        block = triton.next_power_of_2(half)
        hb = min(triton.next_power_of_2(H), max(1, 2048 // block))   # ~2k elements per half-tile
        _rms_norm_rope_kernel[(B * S, triton.cdiv(H, hb))](
            x, weight, cos, sin, out, H, S, x.stride(0), x.stride(1), x.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), D, half, eps,
            HB=hb, BLOCK=block, num_warps=4 if hb * block <= 1024 else 8,
        )
    return out
