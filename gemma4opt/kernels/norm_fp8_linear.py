"""Triton one-row fp8 GEMM whose input is a residual tail quantized in the GEMM: one launch for two.

    s = residual + rms_norm(x, w1)  (times scale)            kernels/add_rms_norm.py's roundings
    n = rms_norm(s, w2);  q, x_scale = quantize_rows(n)      kernels/fp8_quant.py's
    y = (q @ W_fp8^T) * x_scale * w_scale                    kernels/fp8_linear.py's row sums

kernels/norm_linear.py's idea with fp8 weights (quantization="fp8"), where the tail is
add_rms_norm_quant (~3.6 µs at one e4b row on an H200, profile_e4b_fp8_h200.txt): every program
computes the row's norm factors and n's amax from the whole row (L2), then makes each input tile
from x, the residual and the norm weights, quantizes it with that scale and multiplies it as the
fp8 GEMM's row-sum tiles do (e4m3 -> fp32). Where the factors agree with the tail kernel's, q and
x_scale are its bytes and y is the fp8 GEMM's; the factors' sums may add in another order.
One row, K <= kernels/norm_linear.py's MAX_K, the fp8 GEMM's one-row row-sum tiles (no split).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import COMPILED as _COMPILED, dense, pdl_flags, pdl_prologue, rows_view
from gemma4opt.kernels.fp8_linear import _ROW_SUM, ROW_SUM_PIPE, pipe_offered
from gemma4opt.kernels.fp8_quant import fp8_quantize, fp8_row_scale
from gemma4opt.kernels.norm_linear import _factors, _input_tile, one_short_row
from gemma4opt.kernels.skinny_linear import TUNERS, bench_short


@triton.jit
def _norm_fp8_linear_kernel(X, R, W1, SCALE, W2, S, W, WS, Y, N, K, swn, eps1, eps2,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                            HAS_SCALE: tl.constexpr, COMPILED: tl.constexpr, PDL: tl.constexpr, PIPE: tl.constexpr = 0):
    # PIPE: the K loop pipelined in PIPE stages (kernels/skinny_linear.py's _ROW_PIPE).
    pdl_prologue(PDL)
    dt = S.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < K
    w2 = tl.load(W2 + cols, mask=cmask, other=0.0).to(tl.float32)
    s, inv1, inv2, scale = _factors(X, R, W1, SCALE, S, cols, cmask, K, eps1, eps2, dt, True, HAS_SCALE)
    n_row = (s * inv2 * w2).to(dt).to(tl.float32)
    xs = fp8_row_scale(tl.max(tl.where(cmask, tl.abs(n_row), 0.0), axis=0))
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_rows = W + n.to(tl.int64)[:, None] * swn
    acc = tl.zeros([BLOCK_N], tl.float32)
    if COMPILED:
        for k0 in tl.range(0, K, BLOCK_K, num_stages=PIPE if PIPE > 0 else None):
            acc = _k_tile(acc, X, R, W1, W2, w_rows, k0, K, nmask, inv1, inv2, scale, xs, dt, BLOCK_K, HAS_SCALE)
    else:                   # the interpreter takes no runtime range() bound
        k0 = 0
        while k0 < K:
            acc = _k_tile(acc, X, R, W1, W2, w_rows, k0, K, nmask, inv1, inv2, scale, xs, dt, BLOCK_K, HAS_SCALE)
            k0 += BLOCK_K
    y = acc * xs * tl.load(WS + n, mask=nmask, other=0.0)
    tl.store(Y + n, y.to(Y.dtype.element_ty), mask=nmask)


@triton.jit
def _k_tile(acc, X, R, W1, W2, w_rows, k0, K, nmask, inv1, inv2, scale, xs, dt: tl.constexpr, BLOCK_K: tl.constexpr,
            HAS_SCALE: tl.constexpr):
    """acc += W_fp8[rows, k0:k0+BLOCK_K] . q[k0:k0+BLOCK_K], q the tile's n quantized with the row's scale."""
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    q = fp8_quantize(_input_tile(X, R, W1, W2, k, kmask, inv1, inv2, scale, dt, True, HAS_SCALE), xs)
    return acc + tl.sum(w.to(tl.float32) * q.to(tl.float32)[None, :], 1)


_CONFIGS = [triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=st) for bn, bk, w, _, st in _ROW_SUM]
_CONFIGS += [triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk, PIPE=st), num_warps=w, num_stages=st)
             for bn, bk, w, _, st in ROW_SUM_PIPE]
_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K"], do_bench=bench_short, prune_configs_by={
    "early_config_prune": lambda configs, named_args, **kw: [c for c in configs if pipe_offered(c, named_args["K"])]})(
    _norm_fp8_linear_kernel)
TUNERS.append(_tuned)


def supported(x: torch.Tensor, w_fp8: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """Why this kernel cannot take x (the tail's input), the fp8 weight and the output dtype, or None."""
    why = one_short_row(x)
    if why:
        return why
    if w_fp8.dtype != torch.float8_e4m3fn or w_fp8.shape[1] != x.shape[-1] or w_fp8.stride(1) != 1:
        return (f"weight {w_fp8.dtype} {tuple(w_fp8.shape)} (stride {w_fp8.stride()}) is not e4m3 [N, "
                f"{x.shape[-1]}] with unit stride along K")
    if x.dtype not in (torch.bfloat16, torch.float16) or out_dtype != x.dtype:
        return f"dtypes {x.dtype} -> {out_dtype} (bf16 or fp16, one dtype)"
    return None


def norm_fp8_linear_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           scale: torch.Tensor | None, next_weight: torch.Tensor, next_eps: float,
                           w_fp8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
                           config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = residual + rms_norm(x, weight) (times scale), y = fp8_linear of rms_norm(s,
    next_weight) quantized per row, on w_fp8 with its per-channel scales, for one row (``supported``).
    ``config``: one tile instead of the autotuned one (tests): BLOCK_N, BLOCK_K, num_warps, num_stages."""
    why = supported(x, w_fp8, out_dtype)
    if why is not None or residual.shape != x.shape or w_scale.numel() != w_fp8.shape[0]:
        raise ValueError(f"gemma4opt norm_fp8_linear: {why or 'residual / weight scales do not match x / weight'}")
    x2, r2 = rows_view(x), rows_view(residual)
    weight, scale, next_weight = dense(weight, scale, next_weight)
    K, N = x2.shape[1], w_fp8.shape[0]
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(1, N, dtype=out_dtype, device=x.device)
    args = (x2, r2, weight, scale if scale is not None else weight, next_weight, s, w_fp8,
            w_scale.reshape(N).float().contiguous(), y, N, K, w_fp8.stride(0), eps, next_eps)
    flags = dict(BLOCK_D=triton.next_power_of_2(K), HAS_SCALE=scale is not None, COMPILED=_COMPILED, **pdl_flags(y))
    if config is None and not _COMPILED:
        config = dict(BLOCK_N=4, BLOCK_K=32)
    if config is None:
        _tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, **flags)
    else:
        meta = {**dict(num_warps=4, num_stages=3), **config}
        _norm_fp8_linear_kernel[(triton.cdiv(N, meta["BLOCK_N"]),)](*args, **meta, **flags)
    return s.view(x.shape), y.view(*x.shape[:-1], N)
