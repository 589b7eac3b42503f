"""Triton gelu_tanh(gate) * up, reading gate/up as strided row views (e.g. halves of one merged GEMM)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import pdl_flags, pdl_prologue

_BLOCK = 1024


def _block(n: int, launch: dict | None = None) -> tuple[int, int]:
    """(BLOCK, num_warps) for n = rows x D outputs: ``launch``'s ``block`` and ``warps`` where given
    (``benchmarks/bench_kernels.py --sweep gelu`` times the alternatives to the rule below). From
    that sweep on an H200 (31b, e4b, 26b-a4b at 1-8192 rows, PDL launches): 512 on 4 warps up to 1M
    outputs (decode: 0.80-0.91 us at one row against 0.88-1.08 for 1024 on 4), 1024 on 4 to 4M, 1024
    on 2 beyond (prefill: 255 us against 265 on the 31b at 8192 rows). Each setting was 1.5-2x
    slower outside its range."""
    if launch:
        return launch["block"], launch["warps"]
    if n <= 1 << 20:
        return 512, 4
    return (1024, 4) if n <= 1 << 22 else (1024, 2)


@triton.jit
def _tanh(x):
    # tanh via exp, stable for large |x| (tl.math.tanh is not in every Triton release)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def gelu_tanh_rounded(g, dt):
    """gelu_tanh(g) in fp32 from fp32 g, rounded to dt as HF's eager gelu output is (here and in
    the MoE experts' gate/up kernel)."""
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return (0.5 * g * (1.0 + _tanh(inner))).to(dt).to(tl.float32)


@triton.jit
def gelu_mul_rounded(g, u, dt):
    """HF's ``act_fn(gate) * up`` on fp32 GEMM sums: gate and up rounded to dt (the GEMM's output),
    gelu's output rounded, the product rounded."""
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    return (gelu_tanh_rounded(g, dt) * u).to(dt)


@triton.jit
def _gelu_tanh_mul_kernel(G, U, O, sg, su, so, D, N, BLOCK: tl.constexpr, FLAT: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    if FLAT:    # blocks over all rows x D outputs: no block straddles a row end half-masked
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        row, cols = i // D, i % D
        mask = i < N
    else:       # one row's BLOCK columns: no division per element
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
    dt = O.dtype.element_ty
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    act = gelu_tanh_rounded(g, dt)
    tl.store(O + row * so + cols, (act * u).to(dt), mask=mask)


def gelu_tanh_mul_triton(gate: torch.Tensor, up: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up; ``launch`` = dict(block=, warps=) forces the launch (see _block)."""
    D = gate.shape[-1]
    g2 = gate.reshape(-1, D) if gate.stride(-1) == 1 else gate.contiguous().reshape(-1, D)
    u2 = up.reshape(-1, D) if up.stride(-1) == 1 else up.contiguous().reshape(-1, D)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        block, warps = _block(out.numel(), launch)
        # Rows that are not a whole number of blocks (the 26b-a4b's 2112 columns: 1024-blocks leave
        # 31 % of the lanes masked; 0.76x Inductor at 8192 rows, whose kernel is flat) go flat.
        flat = D % block != 0
        grid = (triton.cdiv(out.numel(), block),) if flat else (out.shape[0], triton.cdiv(D, block))
        _gelu_tanh_mul_kernel[grid](g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), D, out.numel(),
                                    BLOCK=block, FLAT=flat, num_warps=warps, **pdl_flags(out))
    return out.view(gate.shape)
