"""Triton one-row GEMM whose input is a residual tail made in the GEMM: one launch for two.

    s = residual + rms_norm(x, w1)  (times scale)          kernels/add_rms_norm.py's roundings
    a = rms_norm(s, w2) if NEXT else s
    y = a @ W^T;  s is stored too (the new residual stream)

Why: at one decode row the residual tail is a latency-bound kernel of its own (~2 µs on an H200,
profile_e4b_layers_h200.txt) between a GEMM and the next, twice per e4b layer (the layer's end
before the next q/k/v, the MLP's end before the per-layer-input gate). Here every GEMM program
recomputes the row's norm factors from the whole row (K values from L2: a few KB, against each
program's tens of KB of weights) and makes its input tiles from x, residual and the norm weights as
it reads them, elementwise with those factors, so each tile holds the bits the tail kernel would
have stored. The factors' sums may add in another order than the tail kernel's (another block and
warp count), so they may differ from it in the last bit; ops/norm_linear.py checks the result
against the two-launch path before it picks this one.

One row only: at more rows each program would hold every row's norms. K at most ``MAX_K``: the
whole row is held in registers. 8192 takes the 31b's 5376: compiled for sm_90 (Triton 3.6's ptxas)
its tiles take 80-160 registers on 4-8 warps (the whole-K tile of one W row on 4 warps 255), the
fp8 ones 128 on 8 warps, 244-255 on 4, none spilling (tests/kernels/test_compiles_for_sm90.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import COMPILED as _COMPILED, dense, pdl_flags, pdl_prologue, rows_view
from gemma4opt.kernels.add_rms_norm import residual_sum
from gemma4opt.kernels.rms_norm import inv_rms
from gemma4opt.kernels.skinny_linear import (_ROW_PIPE, _ROW_SPLIT, _ROW_SUM, _WHOLE, TUNERS, _out, _sum_splits,
                                             bench_short, k_range, launch_tiles, max_split, row_splits, tile_configs)

MAX_K = 8192


@triton.jit
def _input_tile(X, R, W1, W2, k, kmask, inv1, inv2, scale, dt: tl.constexpr, NEXT: tl.constexpr,
                HAS_SCALE: tl.constexpr):
    """The GEMM input at columns k: the tail's s there (NEXT: its norm), in fp32 of dt-rounded values."""
    x = tl.load(X + k, mask=kmask, other=0.0).to(tl.float32)
    r = tl.load(R + k, mask=kmask, other=0.0).to(tl.float32)
    w1 = tl.load(W1 + k, mask=kmask, other=0.0).to(tl.float32)
    s = residual_sum(x, r, w1, inv1, scale, dt, HAS_SCALE)
    if NEXT:
        w2 = tl.load(W2 + k, mask=kmask, other=0.0).to(tl.float32)
        s = (s * inv2 * w2).to(dt).to(tl.float32)
    return s


@triton.jit
def _factors(X, R, W1, SCALE, S, cols, cmask, K, eps1, eps2, dt: tl.constexpr, NEXT: tl.constexpr,
             HAS_SCALE: tl.constexpr):
    """The row's s (stored by the first program), its norm factors inv1 (x's) and inv2 (s's, with
    NEXT), and the scale (with HAS_SCALE). Every load first: one round trip."""
    x = tl.load(X + cols, mask=cmask, other=0.0).to(tl.float32)
    r = tl.load(R + cols, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(W1 + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(SCALE).to(tl.float32)
    inv1 = inv_rms(x, K, eps1)
    # Without HAS_SCALE / NEXT, scale / inv2 are never read: inv1 stands in, so that every value
    # returned is a tensor.
    if not HAS_SCALE:
        scale = inv1
    s = residual_sum(x, r, w1, inv1, scale, dt, HAS_SCALE)
    inv2 = inv1
    if NEXT:
        inv2 = inv_rms(s, K, eps2)
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
    tl.store(S + cols, s.to(dt), mask=cmask & first)
    return s, inv1, inv2, scale


@triton.jit
def _norm_linear_kernel(X, R, W1, SCALE, W2, S, W, Y, P, M, N, K, swn, sym, eps1, eps2,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, SWAP: tl.constexpr, BLOCK_D: tl.constexpr, NEXT: tl.constexpr,
                        HAS_SCALE: tl.constexpr, COMPILED: tl.constexpr, PDL: tl.constexpr, CAP: tl.constexpr = 0.0,
                        PIPE: tl.constexpr = 0):
    # BLOCK_M (always 1) and SWAP (always False): keys of the autotune configs and prune shared
    # with kernels/skinny_linear.py; PIPE: its K loop pipelined in PIPE stages, as there.
    pdl_prologue(PDL)
    dt = S.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < K
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_rows = W + n.to(tl.int64)[:, None] * swn
    if BLOCK_K == BLOCK_D and SPLIT_K == 1:
        # One tile holds the row: the weights' trip to HBM is issued first, to overlap the norms',
        # and the input is made from the values the norms loaded.
        w = tl.load(w_rows + cols[None, :], mask=nmask[:, None] & cmask[None, :], other=0.0)
        if NEXT:
            w2 = tl.load(W2 + cols, mask=cmask, other=0.0).to(tl.float32)
        s, inv1, inv2, scale = _factors(X, R, W1, SCALE, S, cols, cmask, K, eps1, eps2, dt, NEXT, HAS_SCALE)
        a = s
        if NEXT:
            a = (s * inv2 * w2).to(dt).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * a[None, :], 1)
    else:
        s, inv1, inv2, scale = _factors(X, R, W1, SCALE, S, cols, cmask, K, eps1, eps2, dt, NEXT, HAS_SCALE)
        lo, hi = k_range(K, SPLIT_K, BLOCK_K)
        acc = tl.zeros([BLOCK_N], tl.float32)
        if COMPILED:
            for k0 in tl.range(lo, hi, BLOCK_K, num_stages=PIPE if PIPE > 0 else None):
                acc = _k_tile(acc, X, R, W1, W2, w_rows, k0, hi, nmask, inv1, inv2, scale, dt, BLOCK_K, NEXT,
                              HAS_SCALE)
        else:               # the interpreter takes no runtime range() bound
            k0 = lo
            while k0 < hi:
                acc = _k_tile(acc, X, R, W1, W2, w_rows, k0, hi, nmask, inv1, inv2, scale, dt, BLOCK_K, NEXT,
                              HAS_SCALE)
                k0 += BLOCK_K
    if SPLIT_K == 1:
        tl.store(Y + n, _out(acc, Y.dtype.element_ty, CAP), mask=nmask)
    else:                   # fp32 partial of split sk (row 0 of P[sk, 1, N])
        tl.store(P + tl.program_id(1).to(tl.int64) * N + n, acc, mask=nmask)


@triton.jit
def _k_tile(acc, X, R, W1, W2, w_rows, k0, hi, nmask, inv1, inv2, scale, dt: tl.constexpr, BLOCK_K: tl.constexpr,
            NEXT: tl.constexpr, HAS_SCALE: tl.constexpr):
    """acc += W[rows, k0:k0+BLOCK_K] . input[k0:k0+BLOCK_K], the input made from its columns."""
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < hi
    w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    a = _input_tile(X, R, W1, W2, k, kmask, inv1, inv2, scale, dt, NEXT, HAS_SCALE)
    return acc + tl.sum(w.to(tl.float32) * a[None, :], 1)


# The skinny GEMM's one-row tiles (row sums, whole-K, split-K), offered as it offers them.
_CONFIGS, _keep = tile_configs(_ROW_SUM, [], _WHOLE, [], _ROW_SPLIT, _ROW_PIPE)
_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "NEXT"], do_bench=bench_short, post_hook=_sum_splits,
                         prune_configs_by={"early_config_prune": _keep})(_norm_linear_kernel)
TUNERS.append(_tuned)


def one_short_row(x: torch.Tensor) -> str | None:
    """Why x (the tail's input) is not one row of at most MAX_K, or None: what both tail GEMMs take."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows != 1:
        return f"{rows} rows (one only)"
    if x.shape[-1] > MAX_K:
        return f"K = {x.shape[-1]} (at most {MAX_K})"
    return None


def supported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why this kernel cannot take x (the tail's input) and weight, or None."""
    why = one_short_row(x)
    if why:
        return why
    if weight.shape[1] != x.shape[-1] or weight.stride(1) != 1:
        return f"weight {tuple(weight.shape)} (stride {weight.stride()}) is not [N, {x.shape[-1]}] with unit stride along K"
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return f"dtypes {x.dtype} / {weight.dtype} (bf16 or fp16, one dtype)"
    return None


def norm_linear_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       scale: torch.Tensor | None, next_weight: torch.Tensor | None, next_eps: float,
                       w: torch.Tensor, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = residual + rms_norm(x, weight) (times scale), y = linear(rms_norm(s, next_weight)
    or s without next_weight, w), for one row (``supported``). ``config``: one tile instead of the
    autotuned one (tests): BLOCK_N, BLOCK_K, and optionally SPLIT_K, num_warps, num_stages."""
    why = supported(x, w)
    if why is not None or residual.shape != x.shape:
        raise ValueError(f"gemma4opt norm_linear: {why or f'residual {tuple(residual.shape)} is not x {tuple(x.shape)}'}")
    x2, r2 = rows_view(x), rows_view(residual)
    weight, scale, next_weight = dense(weight, scale, next_weight)
    K, N = x2.shape[1], w.shape[0]
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    part = torch.empty(max_split(N) * N if row_splits(N, K) or (config or {}).get("SPLIT_K", 1) > 1 else 1,
                       dtype=torch.float32, device=x.device)
    args = (x2, r2, weight, scale if scale is not None else weight, next_weight if next_weight is not None else weight,
            s, w, y, part, 1, N, K, w.stride(0), y.stride(0), eps, next_eps)
    flags = dict(BLOCK_M=1, BLOCK_D=triton.next_power_of_2(K), NEXT=next_weight is not None,
                 HAS_SCALE=scale is not None, COMPILED=_COMPILED, **pdl_flags(y))
    if config is None and not _COMPILED:
        config = dict(BLOCK_N=4, BLOCK_K=32)
    split = launch_tiles(_tuned, _norm_linear_kernel, args, flags, config, N, False, "norm_linear")
    _sum_splits(dict(P=part, Y=y, M=1, N=N, SPLIT_K=split, CAP=0.0))
    return s.view(x.shape), y.view(*x.shape[:-1], N)
