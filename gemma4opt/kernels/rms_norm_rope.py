"""Triton per-head RMSNorm (q_norm/k_norm) + rotate_half RoPE in one pass.

x: [B, S, H, D] (any strides with unit stride on D), cos/sin: [B or 1, S, 1, D] broadcast over
heads. Proportional RoPE (full layers, partial rotary 0.25) is the same math: HF zero-pads
inv_freq, so cos=1, sin=0 on the unrotated dims. Output is contiguous [B, S, H, D].

One program handles a block of heads of one token, so cos/sin are read once per block rather
than once per head (per head they would cost as much traffic as x itself). Few tokens (decode)
shrink the block down to one head per program: one token's heads in two programs left the GPU
idle and latency-bound (0.67-0.79x Inductor at M = 1 on an H200).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import dense, pdl_flags, pdl_prologue


@triton.jit
def norm_rope_tile(xp, sxh, W, cb, sb, heads, cols, hmask, cmask, HALF, D, eps, dt):
    """The two rotated halves (fp32) of heads ``heads`` of one token at ``xp``: RMSNorm with
    weight W, rounded to ``dt`` as HF rounds the norm's output, then RoPE with cos/sin at cb/sb."""
    mask = hmask[:, None] & cmask[None, :]
    p = xp + heads[:, None].to(tl.int64) * sxh + cols[None, :]
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
    w1 = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.load(W + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    y1 = (x1 * inv[:, None] * w1[None, :]).to(dt).to(tl.float32)
    y2 = (x2 * inv[:, None] * w2[None, :]).to(dt).to(tl.float32)
    c1 = tl.load(cb + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cb + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sb + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sb + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return y1 * c1 - y2 * s1, y2 * c2 + y1 * s2


@triton.jit
def norm_rope_store(xp, sxh, W, cb, sb, O, tok, H, heads, cols, hmask, cmask, HALF, D, eps):
    """norm_rope_tile of token ``tok``'s heads, stored to row ``tok`` of a contiguous [tokens, H, D] O."""
    dt = O.dtype.element_ty
    o1, o2 = norm_rope_tile(xp, sxh, W, cb, sb, heads, cols, hmask, cmask, HALF, D, eps, dt)
    mask = hmask[:, None] & cmask[None, :]
    op = O + (tok * H + heads[:, None].to(tl.int64)) * D + cols[None, :]
    tl.store(op, o1.to(dt), mask=mask)
    tl.store(op + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rms_norm_rope_kernel(X, W, C, Sn, O, H, S, sxb, sxs, sxh, scb, scs, ssb, sss, D, HALF, eps,
                          HB: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)          # b * S + s
    hblk = tl.program_id(1)
    s = tok % S
    b = tok // S
    heads = hblk * HB + tl.arange(0, HB)
    cols = tl.arange(0, BLOCK)
    norm_rope_store(X + b * sxb + s * sxs, sxh, W, C + b * scb + s * scs, Sn + b * ssb + s * sss, O, tok, H,
                    heads, cols, heads < H, cols < HALF, HALF, D, eps)


def head_block(tokens: int, heads: int, half: int, launch: dict | None = None) -> tuple[int, int, int]:
    """(heads per program, BLOCK, num_warps): ``launch``'s ``hb`` (capped at the heads) and ``warps``
    where given (``benchmarks/bench_kernels.py --sweep-norm-rope`` times the alternatives to the rule
    below), else one warp, ~1k elements of a head group per program, fewer heads per program until
    there are 512+ programs. From the sweep on an H200 (31b, head_dim 256 and 512, 1-8192 tokens):
    one warp won 15 of 16 cases, by 1.2-1.7x over the old 2-8 warps at 32+ tokens (head_dim 512's
    q/k/v prep at 8192 tokens: 312 -> 182 us), with 1-2 heads per program at 1-32 tokens and 2-8
    at 256+."""
    block = triton.next_power_of_2(half)
    if launch:
        return min(triton.next_power_of_2(heads), launch["hb"]), block, launch["warps"]
    hb = min(triton.next_power_of_2(heads), max(1, 512 // block))
    while hb > 1 and tokens * triton.cdiv(heads, hb) < 512:
        hb //= 2
    return hb, block, 1


def expand_cos_sin(cos, sin, B, S, D):
    cos, sin = cos.expand(B, S, 1, D), sin.expand(B, S, 1, D)
    return (cos if cos.stride(-1) == 1 else cos.contiguous()), (sin if sin.stride(-1) == 1 else sin.contiguous())


def rms_norm_rope_triton(x, weight, cos, sin, eps, launch: dict | None = None):
    """``launch`` = dict(hb=, warps=) forces the launch (see head_block)."""
    B, S, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = dense(weight)
    cos, sin = expand_cos_sin(cos, sin, B, S, D)
    out = torch.empty((B, S, H, D), dtype=x.dtype, device=x.device)
    if out.numel():
        hb, block, warps = head_block(B * S, H, D // 2, launch)
        _rms_norm_rope_kernel[(B * S, triton.cdiv(H, hb))](
            x, weight, cos, sin, out, H, S, x.stride(0), x.stride(1), x.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), D, D // 2, eps,
            HB=hb, BLOCK=block, num_warps=warps, **pdl_flags(out),
        )
    return out
