"""Triton producers fused with FP8 (e4m3) per-row quantization: one launch writes a row's fp8
bytes and its fp32 scale (ops/fp8.py states the semantics; the ops are rms_norm_quant,
add_rms_norm_quant and gelu_tanh_mul_quant).

Each producer computes its row exactly as its unfused kernel does (kernels/rms_norm.py,
add_rms_norm.py, gelu_tanh_mul.py) and rounds it to the activation dtype as the unfused op's
output would be, so the bytes equal quantize_rows(unfused kernel's output). The quantizer divides
with tl.math.div_rn (IEEE), not Triton's approximate fp32 ``/``, to match torch's division.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import dense, pdl_flags, pdl_prologue, row_launch, rows_view
from gemma4opt.kernels.add_rms_norm import add_rms_norm_row
from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_rounded

# The same numbers as gemma4opt/ops/fp8.py (kernels import no ops; a test checks they agree).
FP8_MAX = 448.0
SCALE_MIN = 1.0 / (FP8_MAX * 512.0)
_FP8_MAX = tl.constexpr(FP8_MAX)
_SCALE_MIN = tl.constexpr(SCALE_MIN)
_GELU_MAX_BLOCK = 8192      # longer gelu rows (the 31b's 21504) run in chunks, two passes
# Triton 3.6's interpreter converts fp32 to float8e4nv wrongly: a tie rounds away from zero (336 ->
# 352, torch and the GPU's cvt.rn give 320) and a round-up that carries into the exponent loses
# the carry (127.99 -> 64, not 128). Under it values are first rounded to the e4m3 grid in fp32
# (fp8_round_to_grid), which it then converts exactly. The compiled kernel converts directly.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def fp8_row_scale(amax):
    """max(amax / 448, SCALE_MIN), the division rounded as torch rounds it."""
    return tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _SCALE_MIN)


@triton.jit
def fp8_round_to_grid(q):
    """fp32 q (|q| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: adding
    and taking away 1.5 * 2^23 e4m3 ulps makes the fp32 adder round at that ulp (2^-9 below 2^-6,
    where e4m3 is subnormal). The sign is copied back by its bit, so -0.0 and tiny negatives give -0."""
    bits = q.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    ulp_e = tl.maximum(e, -6) - 3
    c = ((ulp_e + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (tl.abs(q) + c) - c
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def fp8_quantize(y, scale):
    """fp32 y / scale, clamped to +-448, as float8e4nv (round to nearest even)."""
    q = tl.math.div_rn(y, scale)
    q = tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)
    if _INTERPRET:
        q = fp8_round_to_grid(q)
    return q.to(tl.float8e4nv)


@triton.jit
def fp8_quant_row_store(y, mask, q_ptrs, s_ptr):
    """Quantize one whole row y (fp32, masked lanes ignored): its fp8 bytes and its scale."""
    scale = fp8_row_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))
    tl.store(q_ptrs, fp8_quantize(y, scale), mask=mask)
    tl.store(s_ptr, scale)


@triton.jit
def _rms_norm_quant_kernel(X, W, Q, S, stride_x, stride_q, D, eps, HAS_WEIGHT: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)     # as kernels/rms_norm.py, op for op
    y = x * inv
    if HAS_WEIGHT:
        y = y * w
    y = y.to(X.dtype.element_ty).to(tl.float32)               # the unfused norm's output dtype
    fp8_quant_row_store(y, mask, Q + row * stride_q + cols, S + row)


@triton.jit
def _add_rms_norm_quant_kernel(X, R, W1, SCALE, W2, S, Q, QS, sx, sr, ss, sq, D, eps1, eps2,
                               HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    # kernels/add_rms_norm.py's arithmetic itself; only the second norm's store differs.
    n = add_rms_norm_row(X, R, W1, SCALE, W2, S, row, sx, sr, ss, cols, mask, D, eps1, eps2, HAS_SCALE)
    fp8_quant_row_store(n, mask, Q + row * sq + cols, QS + row)


@triton.jit
def _gelu_mul_chunk(G, U, row, sg, su, c0, D, dt, BLOCK: tl.constexpr):
    """(gelu_tanh(gate) * up) rounded to dt on columns c0:c0+BLOCK of a row, as kernels/gelu_tanh_mul.py."""
    cols = c0 + tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    return (gelu_tanh_rounded(g, dt) * u).to(dt).to(tl.float32), cols, mask


@triton.jit
def _gelu_tanh_mul_quant_kernel(G, U, Q, S, sg, su, sq, D, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                                PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    dt = G.dtype.element_ty
    if CHUNKS == 1:         # the whole row in registers: one pass
        p, cols, mask = _gelu_mul_chunk(G, U, row, sg, su, 0, D, dt, BLOCK)
        fp8_quant_row_store(p, mask, Q + row * sq + cols, S + row)
    else:                   # pass 1: the row's amax; pass 2: the same values again, quantized
        p, cols, mask = _gelu_mul_chunk(G, U, row, sg, su, 0, D, dt, BLOCK)
        amax = tl.max(tl.where(mask, tl.abs(p), 0.0), axis=0)
        for c in tl.static_range(1, CHUNKS):
            p, cols, mask = _gelu_mul_chunk(G, U, row, sg, su, c * BLOCK, D, dt, BLOCK)
            amax = tl.maximum(amax, tl.max(tl.where(mask, tl.abs(p), 0.0), axis=0))
        scale = fp8_row_scale(amax)
        for c in tl.static_range(CHUNKS):
            p, cols, mask = _gelu_mul_chunk(G, U, row, sg, su, c * BLOCK, D, dt, BLOCK)
            tl.store(Q + row * sq + cols, fp8_quantize(p, scale), mask=mask)
        tl.store(S + row, scale)


def _outputs(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x2.device),
            torch.empty(x2.shape[0], dtype=torch.float32, device=x2.device))


def rms_norm_quant_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x, weight, eps) in x.dtype, quantized per row: (fp8 like x, fp32 scales x.shape[:-1])."""
    D = x.shape[-1]
    x2, weight = rows_view(x), dense(weight)
    q, s = _outputs(x2)
    rows = x2.shape[0]
    if rows:
        block, warps = row_launch(D, rows)
        _rms_norm_quant_kernel[(rows,)](
            x2, weight if weight is not None else x2, q, s, x2.stride(0), q.stride(0), D, eps,
            HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=warps, **pdl_flags(x2),
        )
    return q.view(x.shape), s.view(x.shape[:-1])


def add_rms_norm_quant_triton(x, residual, weight, eps, scale, next_weight, next_eps):
    """kernels/add_rms_norm.py's (s, n) with n quantized per row: (s, fp8 n, fp32 scales)."""
    D = x.shape[-1]
    x2, r2 = rows_view(x), rows_view(residual)
    weight, scale, next_weight = dense(weight, scale, next_weight)
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    q, qs = _outputs(s)
    if s.shape[0]:
        block, warps = row_launch(D, s.shape[0])
        _add_rms_norm_quant_kernel[(s.shape[0],)](
            x2, r2, weight, scale if scale is not None else weight, next_weight, s, q, qs,
            x2.stride(0), r2.stride(0), s.stride(0), q.stride(0), D, eps, next_eps,
            HAS_SCALE=scale is not None, BLOCK=block, num_warps=warps, **pdl_flags(s),
        )
    return s.view(x.shape), q.view(x.shape), qs.view(x.shape[:-1])


def gelu_tanh_mul_quant_triton(gate: torch.Tensor, up: torch.Tensor, max_block: int = _GELU_MAX_BLOCK,
                               split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu_tanh(gate) * up in gate.dtype, quantized per row (gate and up of one shape, rows
    may be strided views such as halves of one merged GEMM output). Rows longer than
    ``max_block`` (a power of two) are read twice, in chunks of it; few long rows are spread over
    programs of ``split`` columns (``_split_columns``), in two launches."""
    if gate.shape != up.shape:
        raise ValueError(f"gemma4opt gelu_tanh_mul_quant: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    D = gate.shape[-1]
    g2, u2 = rows_view(gate), rows_view(up)
    q, s = _outputs(g2)
    rows = g2.shape[0]
    split = _split_columns(rows, D) if split is None else split
    if rows and split:
        _split_quant(g2, u2, q, s, split)
    elif rows:
        block = min(triton.next_power_of_2(max(D, 1)), max_block)
        _, warps = row_launch(block, rows)
        _gelu_tanh_mul_quant_kernel[(rows,)](
            g2, u2, q, s, g2.stride(0), u2.stride(0), q.stride(0), D,
            BLOCK=block, CHUNKS=triton.cdiv(D, block), num_warps=warps, **pdl_flags(g2),
        )
    return q.view(gate.shape), s.view(gate.shape[:-1])


# A row's quantization needs its amax before any byte is written. One program per row is fine for
# many rows, but at decode a gelu row of the 31b (21504 columns, tanh on each) is one SM's work:
# 11 us on an H200, against ~55 us of the GEMM that reads it. So few long gelu rows are spread over
# programs of SPLIT columns in two launches: each program's amax, then each program takes the
# row's amax from those, recomputes its columns and quantizes them. Same values, same bytes. (A bare
# quantize_rows has no tanh to spread: at the 31b's 8192-column attention output one program takes
# ~2.3 us, about what two launches would.)
_SPLIT_MIN_COLUMNS = 4096
_SPLIT_MAX_ROWS = 128


def _split_columns(rows: int, D: int) -> int:
    """Columns per program for the two-launch path (0: one program per row). Chosen for an H200's
    132 SMs: about 16-64 programs per row at decode, fewer but wider ones as the rows grow."""
    if rows >= _SPLIT_MAX_ROWS or D < _SPLIT_MIN_COLUMNS:
        return 0
    return 1024 if rows <= 8 else 2048 if rows <= 32 else 4096


@triton.jit
def _split_amax_kernel(G, U, P, sg, su, D, NP, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    y, cols, mask = _gelu_mul_chunk(G, U, row, sg, su, part * BLOCK, D, G.dtype.element_ty, BLOCK)
    tl.store(P + row * NP + part, tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))


@triton.jit
def _split_quant_kernel(G, U, P, Q, S, sg, su, sq, D, NP, BLOCK: tl.constexpr, NP_BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.arange(0, NP_BLOCK)
    scale = fp8_row_scale(tl.max(tl.load(P + row * NP + parts, mask=parts < NP, other=0.0), axis=0))
    y, cols, mask = _gelu_mul_chunk(G, U, row, sg, su, part * BLOCK, D, G.dtype.element_ty, BLOCK)
    tl.store(Q + row * sq + cols, fp8_quantize(y, scale), mask=mask)
    if part == 0:
        tl.store(S + row, scale)


def _split_quant(x2, u2, q, s, split: int) -> None:
    """The two-launch path over [rows, D] gate and up views: q and s filled."""
    rows, D = x2.shape
    parts = triton.cdiv(D, split)
    amax = torch.empty(rows, parts, dtype=torch.float32, device=x2.device)
    flags = pdl_flags(x2)
    _split_amax_kernel[(rows, parts)](x2, u2, amax, x2.stride(0), u2.stride(0), D, parts,
                                      BLOCK=split, num_warps=4, **flags)
    _split_quant_kernel[(rows, parts)](x2, u2, amax, q, s, x2.stride(0), u2.stride(0), q.stride(0), D, parts,
                                       BLOCK=split, NP_BLOCK=triton.next_power_of_2(parts),
                                       num_warps=4, **flags)


@triton.jit
def _quantize_rows_kernel(X, Q, S, sx, sq, D, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """A row quantized on its own: for an input no gemma4opt kernel produces (the attention output
    before o_proj). Long rows run in chunks, two passes, as the gelu kernel's."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    if CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        fp8_quant_row_store(x, mask, Q + row * sq + cols, S + row)
    else:
        amax = tl.zeros([], tl.float32)
        for c in tl.static_range(CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(X + row * sx + cols, mask=cols < D, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        scale = fp8_row_scale(amax)
        for c in tl.static_range(CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = cols < D
            x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(Q + row * sq + cols, fp8_quantize(x, scale), mask=mask)
        tl.store(S + row, scale)


def quantize_rows_triton(x: torch.Tensor, max_block: int = _GELU_MAX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] quantized per row: (fp8 like x, fp32 scales x.shape[:-1]); ops/fp8.py's semantics."""
    D = x.shape[-1]
    x2 = rows_view(x)
    q, s = _outputs(x2)
    rows = x2.shape[0]
    if rows:
        block = min(triton.next_power_of_2(max(D, 1)), max_block)
        _, warps = row_launch(block, rows)
        _quantize_rows_kernel[(rows,)](x2, q, s, x2.stride(0), q.stride(0), D, BLOCK=block,
                                       CHUNKS=triton.cdiv(D, block), num_warps=warps, **pdl_flags(x2))
    return q.view(x.shape), s.view(x.shape[:-1])
