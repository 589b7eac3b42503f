"""Triton logit softcap in place: x = tanh(x / cap) * cap, rounding like HF (after /, tanh, *)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import pdl_flags, pdl_prologue
from gemma4opt.kernels.gelu_tanh_mul import _tanh

_BLOCK = 2048


@triton.jit
def softcap_rounded(x, dt, cap):
    """tanh(x / cap) * cap in fp32 from fp32 x (already in dt's values), rounded to dt after /,
    tanh and * as HF's eager code is (here and in the skinny GEMM's lm_head epilogue)."""
    t = _tanh((x / cap).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return (t * cap).to(dt)


@triton.jit
def _softcap_kernel(X, N, cap, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dt = X.dtype.element_ty
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(X + offs, softcap_rounded(x, dt, cap), mask=mask)


def softcap_(x: torch.Tensor, cap: float, launch: dict | None = None) -> torch.Tensor:
    """In place on a contiguous tensor (the fresh GEMM output). ``launch`` = dict(block=, warps=)
    forces the launch (``benchmarks/bench_kernels.py --sweep softcap`` times the alternatives)."""
    assert x.is_contiguous()
    n = x.numel()
    if n:
        # ``--sweep softcap`` on an H200: 2048 on 4 warps best at 32 and 256 rows of a 262144 vocabulary;
        # at one row 512 on 8 (1.15 us against 1.28: four times the programs for one row's logits).
        block, warps = (launch["block"], launch["warps"]) if launch else \
            (512, 8) if n <= 1 << 18 else (_BLOCK, 4)
        _softcap_kernel[(triton.cdiv(n, block),)](x, n, cap, BLOCK=block, num_warps=warps, **pdl_flags(x))
    return x
