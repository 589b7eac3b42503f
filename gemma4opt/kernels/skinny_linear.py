"""Triton y = x @ W^T for a few rows (decode: M <= 32), W [N, K] row-major as nn.Linear keeps it.

``gemma4opt.linear`` (ops/linear.py) runs it on the decode shapes where it timed faster than cuBLAS
(``benchmarks/bench_kernels.py --linear`` compares them). Why it can win: at batch 1 the 31b decode step's layer
GEMMs stream their weights at ~3.83 TB/s through cuBLASLt (24 of them per step split K and add a
reduce kernel), while the lm_head, one plain stream, reaches 4.34 (README, batch-1 profile).
Here each program owns BLOCK_N rows of W and walks all of K: W is read once, in long contiguous
runs, with no split and no second kernel. The tile shape is autotuned per (N, K, row class) on
the first call, which decode graphs make eagerly before capturing.

M == 1: an fp32 multiply-and-row-sum (tensor cores would idle 15 of 16 rows). 2 <= M <= 32:
``tl.dot`` on rows padded to 16 or 32 (padding rows are masked, never stored).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
import triton.testing

from gemma4opt.kernels._util import rows_view

MAX_ROWS = 32
# Triton's interpreter (CPU tests) multiplies bf16 dot tiles as raw integers, takes no runtime
# loop bound and cannot benchmark configs: there tiles go to fp32, the loop is a while loop, and
# one config runs. The compiled kernel keeps the for loop (Triton pipelines its loads).
_COMPILED = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _k_tile(acc, X, w_rows, k0, K, nmask, m, mmask, sxm,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, COMPILED: tl.constexpr, IEEE: tl.constexpr):
    """acc += x[:, k0:k0+BLOCK_K] @ W[rows, k0:k0+BLOCK_K]^T."""
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    if BLOCK_M == 1:
        x = tl.load(X + k, mask=kmask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    else:
        x = tl.load(X + m[:, None] * sxm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if not COMPILED:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if IEEE:        # fp32 models: exact products (Triton's fp32 dot default is TF32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def _skinny_kernel(X, W, Y, M, N, K, sxm, swn, sym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   COMPILED: tl.constexpr, IEEE: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_rows = W + n.to(tl.int64)[:, None] * swn
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if COMPILED:
        for k0 in range(0, K, BLOCK_K):
            acc = _k_tile(acc, X, w_rows, k0, K, nmask, m, mmask, sxm, BLOCK_M, BLOCK_K, COMPILED, IEEE)
    else:           # the interpreter takes no runtime range() bound
        k0 = 0
        while k0 < K:
            acc = _k_tile(acc, X, w_rows, k0, K, nmask, m, mmask, sxm, BLOCK_M, BLOCK_K, COMPILED, IEEE)
            k0 += BLOCK_K
    if BLOCK_M == 1:
        tl.store(Y + n, acc.to(Y.dtype.element_ty), mask=nmask)
    else:
        tl.store(Y + m[:, None] * sym + n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


# (BLOCK_N, BLOCK_K, warps): for one row, few W rows per program (many programs, even work per
# SM) and long K runs; for tl.dot, 16+ W rows and shorter K tiles. Each compiles per (N, K, row
# class): kept short so a warm-up tunes in seconds.
_ROW_SUM = [(bn, bk, w) for bn in (4, 8, 16) for bk in (512, 1024) for w in (4, 8)]
_DOT = [(bn, bk, 4) for bn in (16, 32, 64) for bk in (128, 256)]


def _configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=3)
            for bn, bk, w in dict.fromkeys(_ROW_SUM + _DOT)]


def _keep(configs, named_args, **kwargs):
    """The row-sum path's configs for one row, tl.dot's for more."""
    bm = kwargs.get("BLOCK_M", named_args.get("BLOCK_M"))
    want = set(_ROW_SUM if bm == 1 else _DOT)
    return [c for c in configs if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps) in want] or configs


def _bench(fn, quantiles=None):
    # Short runs: a warm-up tunes every decode GEMM shape (Triton's default spends ~0.13 s a config).
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_tuned = triton.autotune(configs=_configs(), key=["N", "K", "BLOCK_M"], do_bench=_bench,
                         prune_configs_by={"early_config_prune": _keep})(_skinny_kernel)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] with at most MAX_ROWS rows in all, weight [N, K] (unit stride along K) -> [..., N]."""
    x2 = rows_view(x)
    M, K = x2.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemma4opt skinny_linear: {M} rows, at most {MAX_ROWS} (use F.linear)")
    if weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"gemma4opt skinny_linear: weight {tuple(weight.shape)} (stride {weight.stride()}) "
                         f"does not match x [..., {K}] with unit stride along K")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        bm = 1 if M == 1 else 16 if M <= 16 else 32
        args = (x2, weight, y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0))
        flags = dict(BLOCK_M=bm, COMPILED=_COMPILED, IEEE=x.dtype == torch.float32)
        if _COMPILED:
            _tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, **flags)
        else:
            bn = 4 if bm == 1 else 16
            _skinny_kernel[(triton.cdiv(N, bn),)](*args, BLOCK_N=bn, BLOCK_K=32, **flags)
    return y.view(*x.shape[:-1], N)
