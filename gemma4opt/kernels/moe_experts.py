"""Triton MoE experts for decode: each (token, chosen expert) pair's gate/up GEMV with gelu·mul,
then per token the down GEMVs of its k experts, weighted and summed. Two launches per layer.

Why: HF's grouped experts path (sort, gather, histc, cumsum, two grouped GEMMs, gelu, scatter,
sum: ~20 kernels per layer) is built for many tokens per expert. At decode a token has k experts
and most experts see no token, so the work is k weight streams per token: here each program
streams rows of one expert's weights straight from its slot in the stacked parameters, with the
skinny GEMM's one-row tile (kernels/skinny_linear.py).

Rounding follows HF's path: gate/up and down outputs rounded to the model dtype (grouped GEMM
outputs), gelu's output rounded before the multiply (``act_fn(gate) * up``), each expert's output
times its fp32 routing weight in fp32, summed over the k experts in fp32, rounded once at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import pdl_flags, pdl_prologue
from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_rounded
from gemma4opt.kernels.skinny_linear import _COMPILED, row_dot_tile

MAX_PAIRS = 64          # (token, expert) pairs per call: decode (8 tokens of top-8); more -> HF's path


@triton.jit
def _rowsum(A, w_rows, K, nmask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPILED: tl.constexpr):
    """fp32 W[rows, :K] . a[:K] for BLOCK_N rows (a while loop in Triton's interpreter, which
    takes no runtime loop bound)."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    if COMPILED:
        for k0 in range(0, K, BLOCK_K):
            acc = row_dot_tile(acc, A, w_rows, k0, K, nmask, BLOCK_K)
    else:
        k0 = 0
        while k0 < K:
            acc = row_dot_tile(acc, A, w_rows, k0, K, nmask, BLOCK_K)
            k0 += BLOCK_K
    return acc


@triton.jit
def _gate_up_kernel(X, IDX, GU, ACT, H, I, sxt, sge, sgn,
                    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPILED: tl.constexpr,
                    PDL: tl.constexpr):
    """ACT[p, n] = gelu_tanh(x[t] . GU[e, n]) * (x[t] . GU[e, I + n]) for pair p = t * TOPK + j."""
    pdl_prologue(PDL)
    p = tl.program_id(0)
    t = p // TOPK
    e = tl.load(IDX + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    g_rows = GU + e * sge + n.to(tl.int64)[:, None] * sgn
    x = X + t.to(tl.int64) * sxt
    dt = ACT.dtype.element_ty
    g = _rowsum(x, g_rows, H, nmask, BLOCK_N, BLOCK_K, COMPILED).to(dt).to(tl.float32)
    u = _rowsum(x, g_rows + I * sgn, H, nmask, BLOCK_N, BLOCK_K, COMPILED).to(dt).to(tl.float32)
    act = gelu_tanh_rounded(g, dt)
    tl.store(ACT + p.to(tl.int64) * I + n, (act * u).to(dt), mask=nmask)


@triton.jit
def _down_kernel(ACT, IDX, WT, D, OUT, H, I, sde, sdn,
                 TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPILED: tl.constexpr,
                 PDL: tl.constexpr):
    """OUT[t, n] = sum over j of round(ACT[p] . D[e_p, n]) * WT[p], p = t * TOPK + j, in j order."""
    pdl_prologue(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    dt = OUT.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        e = tl.load(IDX + p).to(tl.int64)
        wt = tl.load(WT + p).to(tl.float32)
        rows = D + e * sde + n.to(tl.int64)[:, None] * sdn
        acc = _rowsum(ACT + p.to(tl.int64) * I, rows, I, nmask, BLOCK_N, BLOCK_K, COMPILED)
        total += acc.to(dt).to(tl.float32) * wt
    tl.store(OUT + t.to(tl.int64) * H + n, total.to(dt), mask=nmask)


def _block_k(K: int, most: int) -> int:
    """The longest K tile up to ``most`` that pads K by at most ~10 % (the 26b-a4b's I = 704: 256,
    not 512, which would mask 31 % of its loads)."""
    bk = min(most, triton.next_power_of_2(K))
    while bk > 16 and triton.cdiv(K, bk) * bk > 1.1 * K:
        bk //= 2
    return bk


# Tiles of the two kernels: rows of W per program, the longest K tile (cut to pad K by <= ~10 %),
# warps. ``benchmarks/bench_kernels.py --sweep moe`` times the alternatives (moe_experts_triton's launch).
TILES = dict(gu_n=8, gu_k=512, gu_warps=4, dn_n=4, dn_k=512, dn_warps=4)


def moe_experts_triton(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up: torch.Tensor, down: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """x [T, H], top_k_index / top_k_weights [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H].
    ``launch``: entries of TILES to use instead of TILES' own (the others stay)."""
    T, H = x.shape
    k = top_k_index.shape[-1]
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    if T * k > MAX_PAIRS:
        raise ValueError(f"gemma4opt moe_experts: {T} tokens x top-{k} = {T * k} pairs, at most {MAX_PAIRS} "
                         f"(decode); use the grouped path")
    if gate_up.shape[2] != H or tuple(down.shape) != (E, H, I) or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError(f"gemma4opt moe_experts: gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} do not "
                         f"match x [T, {H}] as [E, 2I, H] / [E, H, I] with unit stride on the last dim")
    x = x if x.stride(-1) == 1 else x.contiguous()
    idx = top_k_index.reshape(-1).contiguous()
    wt = top_k_weights.reshape(-1).contiguous()
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    act = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    t = {**TILES, **(launch or {})}
    _gate_up_kernel[(T * k, triton.cdiv(I, t["gu_n"]))](
        x, idx, gate_up, act, H, I, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        TOPK=k, BLOCK_N=t["gu_n"], BLOCK_K=_block_k(H, t["gu_k"]), COMPILED=_COMPILED, num_warps=t["gu_warps"],
        **pdl_flags(x))
    # Down: one program per H-block of a token (its k pairs summed in it), not per pair.
    _down_kernel[(T, triton.cdiv(H, t["dn_n"]))](
        act, idx, wt, down, out, H, I, down.stride(0), down.stride(1),
        TOPK=k, BLOCK_N=t["dn_n"], BLOCK_K=_block_k(I, t["dn_k"]), COMPILED=_COMPILED, num_warps=t["dn_warps"],
        **pdl_flags(x))
    return out
