"""Triton ``gelu_tanh(x @ Wg^T) * (x @ Wu^T)`` for one decode row: a dense MLP's merged gate/up
GEMV with gelu·mul in its epilogue, one launch where cuBLAS (or the skinny GEMM) and the gelu·mul
kernel took two.

W is the merged [2I, H] weight (merged_projections): gate rows 0..I-1, up rows I..2I-1. Each
program owns BLOCK_N gate rows and the matching up rows, streams both over all of H (the MoE
experts' gate/up kernel's inner loop, kernels/moe_experts.py, for one "expert") and writes
BLOCK_N outputs, rounded as HF's eager MLP rounds (gate and up to the model dtype, gelu's output,
the product). The GEMV sums run in another order than cuBLAS's, as the skinny GEMM's do: which of
the two paths runs is a per-shape pick (ops/gate_up_gelu.py).

FP8 (quantization="fp8"): x is the fp8 row its norm quantized, W the e4m3 merged weight; each row's
sum of e4m3 products (exact in fp32) is scaled by the row's and the channel's scales, as the fp8
GEMM's row sums are (kernels/fp8_linear.py), then rounded to the model dtype as the fp8 GEMM's output
is. ops/gelu_linear.py's fp8 MLP runs it with the down GEMM quantizing its output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import pdl_flags, pdl_prologue
from gemma4opt.kernels.gelu_tanh_mul import gelu_mul_rounded
from gemma4opt.kernels.moe_experts import TILES, TILES_FP8, _block_k, gate_up_sums
from gemma4opt.kernels.skinny_linear import _COMPILED, TUNERS, bench_short

MAX_ROWS = 1        # each row streams all of W again: more rows are the GEMM's work


@triton.jit
def _gate_up_gelu_kernel(X, W, OUT, H, I, sxt, swn, sot, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         COMPILED: tl.constexpr, PDL: tl.constexpr, PIPE: tl.constexpr = 0,
                         XS=None, WS=None, FP8: tl.constexpr = False, AMAX=None, HAS_AMAX: tl.constexpr = False):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    g_rows = W + n.to(tl.int64)[:, None] * swn
    g, u = gate_up_sums(X + t * sxt, g_rows, g_rows + I * swn, H, nmask, BLOCK_N, BLOCK_K, COMPILED, PIPE)
    if FP8:         # the fp8 GEMM's epilogue: sum * x_scale * w_scale (its rounding to dt is gelu_mul_rounded's)
        xs = tl.load(XS + t)
        g = g * xs * tl.load(WS + n, mask=nmask, other=0.0)
        u = u * xs * tl.load(WS + I + n, mask=nmask, other=0.0)
    act = gelu_mul_rounded(g, u, OUT.dtype.element_ty)
    tl.store(OUT + t * sot + n, act, mask=nmask)
    if HAS_AMAX:    # this program's max |act| (as stored): the next GEMM's fp8 scale without a pass over act
        tl.store(AMAX + t * tl.num_programs(1) + tl.program_id(1),
                 tl.max(tl.where(nmask, tl.abs(act.to(tl.float32)), 0.0), 0))


def gate_up_gelu_triton(x: torch.Tensor, weight: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """x [..., H] (at most MAX_ROWS rows), weight [2I, H] with unit stride on H -> [..., I]."""
    return _launch(x, weight, None, None, x.dtype, launch)


def gate_up_gelu_fp8_triton(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype, launch: dict | None = None, amax: bool = False):
    """gelu_tanh_mul of fp8_linear(x_fp8, x_scale, w_fp8, w_scale, out_dtype)'s halves: x_fp8 [..., H]
    (at most MAX_ROWS rows) with fp32 scales [...], w_fp8 [2I, H] e4m3 with fp32 scales [2I] -> [..., I].
    ``amax``: (that, fp32 [rows, programs]): each program's max |output| (the down GEMM's
    quant_fp8_linear_triton takes a row's as its amax_parts)."""
    rows = x_fp8.numel() // max(x_fp8.shape[-1], 1)
    if x_scale.numel() != rows or w_scale.numel() != w_fp8.shape[0]:
        raise ValueError(f"gemma4opt gate_up_gelu_fp8: scales of {x_scale.numel()} rows and {w_scale.numel()} "
                         f"channels for x {tuple(x_fp8.shape)} and weight {tuple(w_fp8.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gemma4opt gate_up_gelu_fp8: output dtype {out_dtype} (bf16, fp16 or fp32)")
    return _launch(x_fp8, w_fp8, x_scale.reshape(-1).float().contiguous(),
                   w_scale.reshape(-1).float().contiguous(), out_dtype, launch, amax)


# The fp8 GEMV's tile is autotuned per (H, I) on its first call (the bf16 one takes the MoE kernels' TILES):
# row-sum tiles of (BLOCK_N gate + BLOCK_N up rows, BLOCK_K, warps) around the fp8 experts' (8, 512, 8),
# from 4 to 16 rows a program, for weights from the e2b's 18.9 MB to the 31b's 231 MB.
_FP8_TILES = [(8, 512, 8), (8, 512, 4), (4, 512, 4), (4, 1024, 4), (8, 1024, 8), (16, 256, 8), (16, 512, 8)]
_tuned_fp8 = triton.autotune(
    configs=[triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w) for bn, bk, w in _FP8_TILES],
    key=["H", "I", "HAS_AMAX"], do_bench=bench_short)(_gate_up_gelu_kernel)
TUNERS.append(_tuned_fp8)


def _launch(x, weight, xs, ws, out_dtype, launch, amax=False):
    H = x.shape[-1]
    two_i = weight.shape[0]
    rows = x.numel() // max(H, 1)
    if rows > MAX_ROWS or two_i % 2 or weight.shape[1] != H or weight.stride(1) != 1:
        raise ValueError(f"gemma4opt gate_up_gelu: x {tuple(x.shape)} and weight {tuple(weight.shape)}: needs at most "
                         f"{MAX_ROWS} row(s) and a [2I, {H}] weight with unit stride on its last dim")
    I = two_i // 2
    x2 = x.reshape(rows, H)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(rows, I, dtype=out_dtype, device=x.device)
    fp8 = xs is not None
    # fp8 without a given tile: the autotuned GEMV; else the tile named (TILES / TILES_FP8, or launch).
    tuned = fp8 and launch is None and _COMPILED
    if tuned:
        kernel, meta, least = _tuned_fp8, {}, min(bn for bn, _, _ in _FP8_TILES)
    else:
        t = {**(TILES_FP8 if fp8 else TILES), **(launch or {})}
        kernel, least = _gate_up_gelu_kernel, t["gu_n"]
        meta = dict(BLOCK_N=t["gu_n"], BLOCK_K=_block_k(H, t["gu_k"]), PIPE=t["gu_pipe"], num_warps=t["gu_warps"])
    # Room for the most programs any tile makes; the programs the tile ran are the ones returned.
    parts = torch.empty(rows, triton.cdiv(I, least), dtype=torch.float32, device=x.device) if amax else None
    if rows:
        kernel[lambda m: (rows, triton.cdiv(I, m["BLOCK_N"]))](
            x2, weight, out, H, I, x2.stride(0), weight.stride(0), out.stride(0), COMPILED=_COMPILED,
            XS=xs, WS=ws, FP8=fp8, AMAX=parts, HAS_AMAX=amax, **meta, **pdl_flags(x))
        if amax and tuned:
            parts = parts[:, :triton.cdiv(I, kernel.best_config.kwargs["BLOCK_N"])]
    out = out.reshape(*x.shape[:-1], I)
    return (out, parts) if amax else out
