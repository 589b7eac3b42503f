"""Triton gelu_tanh(gate) * up, reading gate/up as strided row views (e.g. halves of one merged GEMM)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import pdl_flags, pdl_prologue

_BLOCK = 1024


# (BLOCK, num_warps) forced by ``benchmarks/bench_kernels.py --sweep-gelu``, which times the
# alternatives to _block.
LAUNCH_OVERRIDE: dict = {}


def _block(D: int) -> tuple[int, int]:
    """(BLOCK, num_warps). 1024 columns on 4 warps everywhere: 256-column blocks on 2 warps for the
    26b-a4b's 2112 columns (to mask less of a row's last block) measured 0.73x and 0.30x Inductor
    at 256 and 8192 rows on an H200, against 1.09x and 0.76x for 1024."""
    if LAUNCH_OVERRIDE:
        return LAUNCH_OVERRIDE["block"], LAUNCH_OVERRIDE["warps"]
    return _BLOCK, 4


@triton.jit
def _tanh(x):
    # tanh via exp, stable for large |x| (tl.math.tanh is not in every Triton release)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _gelu_tanh_mul_kernel(G, U, O, sg, su, so, D, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    dt = O.dtype.element_ty
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    act = (0.5 * g * (1.0 + _tanh(inner))).to(dt).to(tl.float32)   # HF rounds gelu's output
    tl.store(O + row * so + cols, (act * u).to(dt), mask=mask)


def gelu_tanh_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    D = gate.shape[-1]
    g2 = gate.reshape(-1, D) if gate.stride(-1) == 1 else gate.contiguous().reshape(-1, D)
    u2 = up.reshape(-1, D) if up.stride(-1) == 1 else up.contiguous().reshape(-1, D)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        block, warps = _block(D)
        grid = (out.shape[0], triton.cdiv(D, block))
        _gelu_tanh_mul_kernel[grid](g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), D, BLOCK=block,
                                    num_warps=warps, **pdl_flags(out))
    return out.view(gate.shape)
