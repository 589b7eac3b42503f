"""Triton RoPE tables of a step: cos and sin of position x inv_freq, both halves, in one launch.

HF's rotary embedding makes them with 8-9 kernels per layer type (the product, the concat, cos,
sin, the two scalings, the two casts), 16-18 tiny launches at the start of every decode step.
Here one program per position row computes each frequency once and writes it to both halves of
cos and of sin. fp32 throughout, as HF computes it, with libdevice's cos and sin (PyTorch's CUDA
kernels call CUDA's cosf and sinf): ops/rope_cos_sin.py checks the bits against PyTorch's over every
position once per device before the kernel is used, and runs PyTorch's ops if they differ.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gemma4opt.kernels._util import COMPILED as _COMPILED, pdl_flags, pdl_prologue


@triton.jit
def _rope_cos_sin_kernel(POS, INV, COS, SIN, scaling, HALF, BLOCK: tl.constexpr, COMPILED: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    mask = j < HALF
    pos = tl.load(POS + row).to(tl.float32)            # position_ids.float(): int64 -> fp32, nearest
    f = pos * tl.load(INV + j, mask=mask, other=0.0).to(tl.float32)
    if COMPILED:        # the interpreter (CPU tests) has no libdevice: numpy's cos and sin stand in
        c, s = libdevice.cos(f), libdevice.sin(f)
    else:
        c, s = tl.cos(f), tl.sin(f)
    c = (c * scaling).to(COS.dtype.element_ty)
    s = (s * scaling).to(SIN.dtype.element_ty)
    out = row * (2 * HALF) + j                          # emb = cat((freqs, freqs), -1)
    tl.store(COS + out, c, mask=mask)
    tl.store(COS + out + HALF, c, mask=mask)
    tl.store(SIN + out, s, mask=mask)
    tl.store(SIN + out + HALF, s, mask=mask)


def rope_cos_sin_triton(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each position_ids.shape + (2 * len(inv_freq),) in ``dtype``."""
    half = inv_freq.shape[-1]
    shape = (*position_ids.shape, 2 * half)
    cos = torch.empty(shape, dtype=dtype, device=position_ids.device)
    sin = torch.empty(shape, dtype=dtype, device=position_ids.device)
    pos = position_ids.reshape(-1).contiguous()
    if pos.numel() and half:
        _rope_cos_sin_kernel[(pos.numel(),)](pos, inv_freq.contiguous(), cos, sin, float(scaling), half,
                                             BLOCK=triton.next_power_of_2(half), COMPILED=_COMPILED,
                                             num_warps=1 if half <= 128 else 2, **pdl_flags(cos))
    return cos, sin
