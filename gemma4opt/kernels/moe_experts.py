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
from gemma4opt.kernels.gelu_tanh_mul import gelu_mul_rounded
from gemma4opt.kernels.moe_grouped import MAX_GROUPED_PAIRS, moe_experts_grouped_triton
from gemma4opt.kernels.skinny_linear import _COMPILED

MAX_PAIRS = 64          # (token, expert) pairs pair by pair: 8 tokens of top-8; more -> kernels/moe_grouped.py


@triton.jit
def _gate_up_tile(acc_g, acc_u, x, g_rows, u_rows, k0, K, nmask, BLOCK_K: tl.constexpr):
    """acc_g[i] += G[row i, k-tile] . x[k-tile] and acc_u likewise, in fp32: both weight tiles are
    loaded before either sum, so a program has two streams in flight, not one after the other."""
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    wmask = nmask[:, None] & kmask[None, :]
    g = tl.load(g_rows + k[None, :], mask=wmask, other=0.0)
    u = tl.load(u_rows + k[None, :], mask=wmask, other=0.0)
    a = tl.load(x + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
    return acc_g + tl.sum(g.to(tl.float32) * a, 1), acc_u + tl.sum(u.to(tl.float32) * a, 1)


@triton.jit
def gate_up_sums(x, g_rows, u_rows, H, nmask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPILED: tl.constexpr,
                 PIPE: tl.constexpr = 0):
    """(g, u) [BLOCK_N] fp32: the gate rows' and the up rows' dot products with x over all of H;
    PIPE > 0: the loop's loads pipelined that many stages deep (kernels/skinny_linear.py's _ROW_PIPE)."""
    g = tl.zeros([BLOCK_N], tl.float32)
    u = tl.zeros([BLOCK_N], tl.float32)
    if COMPILED:
        for k0 in tl.range(0, H, BLOCK_K, num_stages=PIPE if PIPE > 0 else None):
            g, u = _gate_up_tile(g, u, x, g_rows, u_rows, k0, H, nmask, BLOCK_K)
    else:           # the interpreter takes no runtime range() bound
        k0 = 0
        while k0 < H:
            g, u = _gate_up_tile(g, u, x, g_rows, u_rows, k0, H, nmask, BLOCK_K)
            k0 += BLOCK_K
    return g, u


@triton.jit
def _gate_up_kernel(X, IDX, GU, GS, ACT, H, I, sxt, sge, sgn,
                    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPILED: tl.constexpr,
                    FP8: tl.constexpr, PDL: tl.constexpr, PIPE: tl.constexpr = 0):
    """ACT[p, n] = gelu_tanh(x[t] . GU[e, n]) * (x[t] . GU[e, I + n]) for pair p = t * TOPK + j.
    FP8: GU is e4m3 with one fp32 scale per (expert, row), GS [E, 2I], applied to each row's sum."""
    pdl_prologue(PDL)
    p = tl.program_id(0)
    t = p // TOPK
    e = tl.load(IDX + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    g_rows = GU + e * sge + n.to(tl.int64)[:, None] * sgn
    g, u = gate_up_sums(X + t.to(tl.int64) * sxt, g_rows, g_rows + I * sgn, H, nmask, BLOCK_N, BLOCK_K, COMPILED, PIPE)
    if FP8:
        g = g * tl.load(GS + e * 2 * I + n, mask=nmask, other=0.0)
        u = u * tl.load(GS + e * 2 * I + I + n, mask=nmask, other=0.0)
    tl.store(ACT + p.to(tl.int64) * I + n, gelu_mul_rounded(g, u, ACT.dtype.element_ty), mask=nmask)


@triton.jit
def _down_tile(acc, a_rows, w_rows, k0, K, jmask, wmask, BLOCK_K: tl.constexpr):
    """acc[j, i] += D[e_j, row i, k-tile] . act[p_j, k-tile] for every pair j of the token at once."""
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    w = tl.load(w_rows + k[None, None, :], mask=wmask & kmask[None, None, :], other=0.0)
    a = tl.load(a_rows + k[None, :], mask=jmask[:, None] & kmask[None, :], other=0.0)
    return acc + tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], 2)


@triton.jit
def _down_kernel(ACT, IDX, WT, D, DS, OUT, H, I, sde, sdn,
                 TOPK: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 COMPILED: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr, PIPE: tl.constexpr = 0):
    """OUT[t, n] = sum over j of round(ACT[p] . D[e_p, n]) * WT[p], p = t * TOPK + j, in j order.

    The token's TOPK experts are one [J, BLOCK_N, BLOCK_K] tile (J: TOPK padded to a power of two),
    so all their weight rows stream at once; looping over the experts one after the other left each
    program with one load in flight (36.8 us for the 26b-a4b's 8 x 4 MB at one token on the H200,
    5x its bytes' time). The rounded, weighted products are then added in j order, one masked
    row at a time, which is exact: every other lane adds 0. FP8: D is e4m3 with one fp32 scale per
    (expert, row), DS [E, H], applied to each row's sum."""
    pdl_prologue(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    j = tl.arange(0, J)
    jmask = j < TOPK
    p = t * TOPK + j
    e = tl.load(IDX + p, mask=jmask, other=0).to(tl.int64)
    wt = tl.load(WT + p, mask=jmask, other=0.0).to(tl.float32)
    w_rows = D + e[:, None, None] * sde + n.to(tl.int64)[None, :, None] * sdn
    a_rows = ACT + p.to(tl.int64)[:, None] * I
    wmask = jmask[:, None, None] & nmask[None, :, None]
    dt = OUT.dtype.element_ty
    acc = tl.zeros([J, BLOCK_N], tl.float32)
    if COMPILED:
        for k0 in tl.range(0, I, BLOCK_K, num_stages=PIPE if PIPE > 0 else None):
            acc = _down_tile(acc, a_rows, w_rows, k0, I, jmask, wmask, BLOCK_K)
    else:
        k0 = 0
        while k0 < I:
            acc = _down_tile(acc, a_rows, w_rows, k0, I, jmask, wmask, BLOCK_K)
            k0 += BLOCK_K
    if FP8:
        acc = acc * tl.load(DS + e[:, None] * H + n[None, :], mask=jmask[:, None] & nmask[None, :], other=0.0)
    r = acc.to(dt).to(tl.float32) * wt[:, None]
    total = tl.zeros([BLOCK_N], tl.float32)
    for jj in tl.static_range(TOPK):
        total += tl.sum(tl.where(j[:, None] == jj, r, 0.0), 0)
    tl.store(OUT + t.to(tl.int64) * H + n, total.to(dt), mask=nmask)


def _block_k(K: int, most: int) -> int:
    """The longest K tile up to ``most`` that pads K by at most ~10 % (the 26b-a4b's I = 704: 256,
    not 512, which would mask 31 % of its loads)."""
    bk = min(most, triton.next_power_of_2(K))
    while bk > 16 and triton.cdiv(K, bk) * bk > 1.1 * K:
        bk //= 2
    return bk


# Tiles of the two kernels: rows of W per program, the longest K tile (cut to pad K by <= ~10 %),
# warps. ``benchmarks/bench_kernels.py --sweep moe`` times the alternatives (moe_experts_triton's launch):
# at the 26b-a4b's shapes on an H200 (benchmarks/results/sweeps_h200.jsonl) gate/up's best at one token
# was 256-wide K tiles on 8 warps (31.2 us for the op against 35.0 with 512 on 4; 175.8 against 177.0
# at 8 tokens), down's best at 8 tokens 2 rows per program (160.8 against 177.0; 33.6 against 35.0 at one).
TILES = dict(gu_n=8, gu_k=256, gu_warps=8, dn_n=2, dn_k=256, dn_warps=4, gu_pipe=0, dn_pipe=0)
# fp8 experts (e4m3 weights, half the bytes a row): their own tiles, from ``bench_kernels.py --sweep
# moe_fp8`` at the 26b-a4b's shapes on an H200 (sweeps_h200.jsonl, each tile against the bf16 tiles):
# gate/up's 512-wide K tiles on 8 warps were faster at 1, 4 and 8 tokens (19.5 / 62.1 / 114.0 us
# against 21.2 / 68.0 / 124.8); down on 2 warps 2 rows a program at one token (19.1), 4 rows above
# (64.1 / 118.6). The grouped kernels at decode's pair counts took 66.6 us at one token.
TILES_FP8 = dict(gu_n=8, gu_k=512, gu_warps=8, dn_n=2, dn_k=256, dn_warps=2, gu_pipe=0, dn_pipe=0)
# gu_pipe / dn_pipe: the K loop's loads pipelined that many stages deep (0: the plain loop, which makes
# one trip to memory per tile; kernels/skinny_linear.py's _ROW_PIPE). Off until timed on a GPU
# (``bench_kernels.py --sweep moe_pipe``, bench_generate's ``-moe-pipe`` systems).
TILES_FP8_ROWS = dict(dn_n=4)      # over TILES_FP8 for more than one token


def moe_experts_triton(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up: torch.Tensor, down: torch.Tensor, launch: dict | None = None,
                       gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                       grouped: bool | None = None) -> torch.Tensor:
    """x [T, H], top_k_index / top_k_weights [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H].
    Up to MAX_PAIRS (token, expert) pairs the two pair-by-pair kernels here run, up to
    kernels/moe_grouped.py's MAX_GROUPED_PAIRS its expert-by-expert ones (``grouped`` forces one
    or the other). ``launch``: entries of the chosen path's TILES to use instead of its own. fp8
    experts (quantization="fp8"): gate_up and down in e4m3 with fp32 scales [E, 2I] and [E, H], one
    per (expert, output row); x stays in its dtype (the GEMVs are bound by the weights' bytes)."""
    T, H = x.shape
    k = top_k_index.shape[-1]
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    if T * k > MAX_GROUPED_PAIRS or (grouped is False and T * k > MAX_PAIRS):
        most = MAX_PAIRS if grouped is False else MAX_GROUPED_PAIRS
        raise ValueError(f"gemma4opt moe_experts: {T} tokens x top-{k} = {T * k} pairs, at most {most} "
                         f"(decode); use the grouped path")
    if gate_up.shape[2] != H or tuple(down.shape) != (E, H, I) or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError(f"gemma4opt moe_experts: gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} do not "
                         f"match x [T, {H}] as [E, 2I, H] / [E, H, I] with unit stride on the last dim")
    fp8 = gate_up_scale is not None
    if fp8 != (down_scale is not None) or (fp8 and (tuple(gate_up_scale.shape) != (E, two_i)
                                                    or tuple(down_scale.shape) != (E, H))):
        raise ValueError(f"gemma4opt moe_experts: fp8 experts need both scales, [E, 2I] = {[E, two_i]} and "
                         f"[E, H] = {[E, H]}")
    if fp8:
        gate_up_scale = gate_up_scale.float().contiguous()
        down_scale = down_scale.float().contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    if grouped or (grouped is None and T * k > MAX_PAIRS):
        return moe_experts_grouped_triton(x, top_k_index, top_k_weights, gate_up, down, launch,
                                          gate_up_scale, down_scale)
    idx = top_k_index.reshape(-1).contiguous()
    wt = top_k_weights.reshape(-1).contiguous()
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    act = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    t = {**TILES, **(launch or {})} if not fp8 else {**TILES_FP8, **(TILES_FP8_ROWS if T > 1 else {}), **(launch or {})}
    _gate_up_kernel[(T * k, triton.cdiv(I, t["gu_n"]))](
        x, idx, gate_up, gate_up_scale if fp8 else wt, act, H, I, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        TOPK=k, BLOCK_N=t["gu_n"], BLOCK_K=_block_k(H, t["gu_k"]), COMPILED=_COMPILED, FP8=fp8,
        PIPE=t["gu_pipe"], num_warps=t["gu_warps"], **pdl_flags(x))
    # Down: one program per H-block of a token (its k pairs summed in it), not per pair.
    _down_kernel[(T, triton.cdiv(H, t["dn_n"]))](
        act, idx, wt, down, down_scale if fp8 else wt, out, H, I, down.stride(0), down.stride(1),
        TOPK=k, J=triton.next_power_of_2(k), BLOCK_N=t["dn_n"], BLOCK_K=_block_k(I, t["dn_k"]), COMPILED=_COMPILED,
        FP8=fp8, PIPE=t["dn_pipe"], num_warps=t["dn_warps"], **pdl_flags(x))
    return out
