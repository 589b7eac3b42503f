"""Triton MoE experts for decode batches of more than kernels/moe_experts.py's MAX_PAIRS (token,
expert) pairs: each expert that has tokens reads its weights once for all of them.

Why: the pair-by-pair kernels stream an expert's weights once per (token, expert) pair. At 8
tokens of top-8 (64 pairs over ~52 distinct experts of the 26b-a4b) the L2 catches the repeats,
but at 32 tokens (256 pairs over ~112 experts, 12 MB each) it cannot, and HF's grouped path,
which took over, ran the 26b-a4b's decode step at 60 ms against a 10.8 ms roofline (H200).

Three launches per layer:
- gate/up: grid (experts, I blocks). The program of expert e finds its pairs in the pairs sorted
  by expert (``torch.sort``: no host sync, so it runs inside a decode graph), then per chunk of
  PP pairs multiplies its [BLOCK_N, H] gate and up rows by the pairs' tokens with ``tl.dot``
  (the weight rows as the dot's M side, the few tokens as N, as the skinny GEMM's SWAP tiles),
  gelu·mul in the epilogue. Experts with no pair exit at once.
- down: the same grid over H; each pair's output row rounded to the model dtype (HF's grouped
  GEMM output) into a [pairs, H] buffer.
- combine: per token, its k rows times their fp32 routing weights, summed in slot order and
  rounded once (HF's order and roundings, as the pair-by-pair down kernel does).

fp8 experts (quantization="fp8"): the e4m3 rows are converted to the tokens' dtype before the dot
(exact: every e4m3 value is a bf16, fp16 and fp32 value) and the (expert, row) scales applied to
each row's sums, as in kernels/moe_experts.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import pdl_flags, pdl_prologue
from gemma4opt.kernels.gelu_tanh_mul import gelu_mul_rounded
from gemma4opt.kernels.skinny_linear import _COMPILED

MAX_GROUPED_PAIRS = 1024    # 128 tokens of top-8: the sorted expert ids are loaded whole by every program
PP = 16                     # pairs per dot: tl.dot's smallest N; an expert with more loops over chunks


@triton.jit
def _expert_span(SORTED, P, e, P_PAD: tl.constexpr):
    """(start, count) of expert e's pairs in the pairs sorted by expert."""
    i = tl.arange(0, P_PAD)
    s = tl.load(SORTED + i, mask=i < P, other=2 ** 30)
    return tl.sum((s < e).to(tl.int32), 0), tl.sum((s == e).to(tl.int32), 0)


@triton.jit
def _dot_rows(acc, w, a, COMPILED: tl.constexpr, IEEE: tl.constexpr):
    """acc [BLOCK_N, PP] += w [BLOCK_N, BLOCK_K] @ a [PP, BLOCK_K]^T, w converted to a's dtype
    (e4m3 -> exact); the interpreter multiplies 16-bit tiles as raw integers: fp32 there."""
    w = w.to(a.dtype)
    if not COMPILED:
        w, a = w.to(tl.float32), a.to(tl.float32)
    if IEEE:
        acc += tl.dot(w, tl.trans(a), input_precision="ieee")
    else:
        acc += tl.dot(w, tl.trans(a))
    return acc


@triton.jit
def _gate_up_tile(acc_g, acc_u, x_rows, g_rows, u_rows, k0, H, nmask, valid, BLOCK_K: tl.constexpr,
                  COMPILED: tl.constexpr, IEEE: tl.constexpr):
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < H
    wmask = nmask[:, None] & kmask[None, :]
    wg = tl.load(g_rows + k[None, :], mask=wmask, other=0.0)
    wu = tl.load(u_rows + k[None, :], mask=wmask, other=0.0)
    a = tl.load(x_rows + k[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
    return _dot_rows(acc_g, wg, a, COMPILED, IEEE), _dot_rows(acc_u, wu, a, COMPILED, IEEE)


@triton.jit
def _down_tile(acc, a_rows, w_rows, k0, I, nmask, valid, BLOCK_K: tl.constexpr, COMPILED: tl.constexpr,
               IEEE: tl.constexpr):
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < I
    w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    a = tl.load(a_rows + k[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
    return _dot_rows(acc, w, a, COMPILED, IEEE)


@triton.jit
def _gate_up_chunk(X, ORDER, GU, GS, ACT, start, c0, count, e, H, I, sxt, sge, sgn,
                   TOPK: tl.constexpr, PP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   COMPILED: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    s = c0 + tl.arange(0, PP)
    valid = s < count
    pair = tl.load(ORDER + start + s, mask=valid, other=0).to(tl.int64)
    x_rows = X + (pair // TOPK)[:, None] * sxt
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    g_rows = GU + e * sge + n.to(tl.int64)[:, None] * sgn
    u_rows = g_rows + I * sgn
    acc_g = tl.zeros([BLOCK_N, PP], tl.float32)
    acc_u = tl.zeros([BLOCK_N, PP], tl.float32)
    if COMPILED:
        for k0 in range(0, H, BLOCK_K):
            acc_g, acc_u = _gate_up_tile(acc_g, acc_u, x_rows, g_rows, u_rows, k0, H, nmask, valid, BLOCK_K,
                                         COMPILED, IEEE)
    else:           # the interpreter takes no runtime range() bound
        k0 = 0
        while k0 < H:
            acc_g, acc_u = _gate_up_tile(acc_g, acc_u, x_rows, g_rows, u_rows, k0, H, nmask, valid, BLOCK_K,
                                         COMPILED, IEEE)
            k0 += BLOCK_K
    if FP8:
        acc_g = acc_g * tl.load(GS + e * 2 * I + n, mask=nmask, other=0.0)[:, None]
        acc_u = acc_u * tl.load(GS + e * 2 * I + I + n, mask=nmask, other=0.0)[:, None]
    act = gelu_mul_rounded(acc_g, acc_u, ACT.dtype.element_ty)
    tl.store(ACT + pair[None, :] * I + n[:, None], act, mask=nmask[:, None] & valid[None, :])


@triton.jit
def _grouped_gate_up_kernel(X, ORDER, SORTED, GU, GS, ACT, P, H, I, sxt, sge, sgn,
                            TOPK: tl.constexpr, P_PAD: tl.constexpr, PP: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, COMPILED: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                            PDL: tl.constexpr):
    """ACT[p, n] = gelu_tanh(x[t] . GU[e, n]) * (x[t] . GU[e, I + n]) for every pair p = t * TOPK + j
    routed to this program's expert e; GS [E, 2I] the fp8 rows' scales."""
    pdl_prologue(PDL)
    e = tl.program_id(0)
    start, count = _expert_span(SORTED, P, e, P_PAD)
    e = e.to(tl.int64)
    if COMPILED:
        for c0 in range(0, count, PP):
            _gate_up_chunk(X, ORDER, GU, GS, ACT, start, c0, count, e, H, I, sxt, sge, sgn,
                           TOPK, PP, BLOCK_N, BLOCK_K, COMPILED, IEEE, FP8)
    else:           # the interpreter takes no loaded value as a range() bound
        c0 = 0
        while c0 < count:
            _gate_up_chunk(X, ORDER, GU, GS, ACT, start, c0, count, e, H, I, sxt, sge, sgn,
                           TOPK, PP, BLOCK_N, BLOCK_K, COMPILED, IEEE, FP8)
            c0 += PP


@triton.jit
def _down_chunk(ACT, ORDER, D, DS, Y, start, c0, count, e, H, I, sde, sdn,
                PP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                COMPILED: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    s = c0 + tl.arange(0, PP)
    valid = s < count
    pair = tl.load(ORDER + start + s, mask=valid, other=0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    w_rows = D + e * sde + n.to(tl.int64)[:, None] * sdn
    a_rows = ACT + pair[:, None] * I
    acc = tl.zeros([BLOCK_N, PP], tl.float32)
    if COMPILED:
        for k0 in range(0, I, BLOCK_K):
            acc = _down_tile(acc, a_rows, w_rows, k0, I, nmask, valid, BLOCK_K, COMPILED, IEEE)
    else:
        k0 = 0
        while k0 < I:
            acc = _down_tile(acc, a_rows, w_rows, k0, I, nmask, valid, BLOCK_K, COMPILED, IEEE)
            k0 += BLOCK_K
    if FP8:
        acc = acc * tl.load(DS + e * H + n, mask=nmask, other=0.0)[:, None]
    tl.store(Y + pair[None, :] * H + n[:, None], acc.to(Y.dtype.element_ty), mask=nmask[:, None] & valid[None, :])


@triton.jit
def _grouped_down_kernel(ACT, ORDER, SORTED, D, DS, Y, P, H, I, sde, sdn,
                         P_PAD: tl.constexpr, PP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         COMPILED: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """Y[p, n] = round(ACT[p] . D[e, n]) for every pair p routed to this program's expert e; DS [E, H]."""
    pdl_prologue(PDL)
    e = tl.program_id(0)
    start, count = _expert_span(SORTED, P, e, P_PAD)
    e = e.to(tl.int64)
    if COMPILED:
        for c0 in range(0, count, PP):
            _down_chunk(ACT, ORDER, D, DS, Y, start, c0, count, e, H, I, sde, sdn, PP, BLOCK_N, BLOCK_K,
                        COMPILED, IEEE, FP8)
    else:
        c0 = 0
        while c0 < count:
            _down_chunk(ACT, ORDER, D, DS, Y, start, c0, count, e, H, I, sde, sdn, PP, BLOCK_N, BLOCK_K,
                        COMPILED, IEEE, FP8)
            c0 += PP


@triton.jit
def _combine_kernel(Y, WT, OUT, H, TOPK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """OUT[t, n] = sum over j, in order, of Y[t * TOPK + j, n] * WT[t * TOPK + j] (fp32), rounded once."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < H
    total = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOPK):
        y = tl.load(Y + (t * TOPK + j) * H + n, mask=nmask, other=0.0).to(tl.float32)
        total += y * tl.load(WT + t * TOPK + j).to(tl.float32)
    tl.store(OUT + t * H + n, total.to(OUT.dtype.element_ty), mask=nmask)


# (BLOCK_N, BLOCK_K, warps, stages) of the gate/up and down kernels. A 64-row weight tile feeds
# Hopper's warpgroup MMA with the pairs as its N side; the down kernel's K tile divides the
# 26b-a4b's I = 704 (11 x 64), so none of its loads is masked.
TILES = dict(gu=(64, 128, 4, 3), dn=(64, 64, 4, 3))


def moe_experts_grouped_triton(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                               gate_up: torch.Tensor, down: torch.Tensor, launch: dict | None = None,
                               gate_up_scale: torch.Tensor | None = None,
                               down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/moe_experts.py's ``moe_experts_triton`` contract (checked there), each expert's
    weights read once per PP of its pairs. ``launch``: ``gu`` / ``dn`` tiles to use instead of TILES'."""
    T, H = x.shape
    k = top_k_index.shape[-1]
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    P = T * k
    fp8 = gate_up_scale is not None
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    sorted_e, order = torch.sort(top_k_index.reshape(-1))     # pairs grouped by expert, on the device
    wt = top_k_weights.reshape(-1).contiguous()
    act = torch.empty(P, I, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    t = {**TILES, **(launch or {})}
    common = dict(P_PAD=triton.next_power_of_2(P), PP=PP, COMPILED=_COMPILED, IEEE=x.dtype == torch.float32,
                  FP8=fp8, **pdl_flags(x))
    bn, bk, warps, stages = t["gu"]
    _grouped_gate_up_kernel[(E, triton.cdiv(I, bn))](
        x, order, sorted_e, gate_up, gate_up_scale if fp8 else wt, act, P, H, I, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), TOPK=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **common)
    bn, bk, warps, stages = t["dn"]
    _grouped_down_kernel[(E, triton.cdiv(H, bn))](
        act, order, sorted_e, down, down_scale if fp8 else wt, y, P, H, I, down.stride(0), down.stride(1),
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **common)
    block = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block))](y, wt, out, H, TOPK=k, BLOCK=block, **pdl_flags(x))
    return out
