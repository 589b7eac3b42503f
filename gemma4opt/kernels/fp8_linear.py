"""Triton FP8 (e4m3) y = (x_q * x_scale) @ (W_q * w_scale)^T for a few rows (decode: M <= 32).

kernels/skinny_linear.py's tiling with fp8 operands: x_q [M, K] and W_q [N, K] (row-major, as
nn.Linear keeps W) multiply in fp32 accumulators (each product of two e4m3 values is exact in fp32),
and the scales — one per token (row of x) and one per output channel (row of W) — are applied once
in the epilogue: y[m, n] = acc[m, n] * x_scale[m] * w_scale[n], cast to the output dtype.

M == 1: an fp32 multiply-and-row-sum, or the tl.dot path below with the row padded to 16 (the
autotuner picks per shape: the fp8 MMA takes e4m3 as it is, where a row sum converts every weight
byte to fp32). 2 <= M <= 32: ``tl.dot`` on the fp8 tiles (Hopper's fp8 warpgroup MMA, each
instruction's partial promoted to the fp32 accumulator), W's rows as the dot's M side (SWAP) as in
skinny_linear, K unsplit or split in 2 or 4 (fp32 partials, summed in split order by a second kernel
that applies the scales). The tile is autotuned per (N, K, row class) on the first call.
ops/fp8_linear.py runs it for <= 32 rows where it timed faster than torch._scaled_mm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import COMPILED as _COMPILED, pdl_flags, pdl_prologue, rows_view
from gemma4opt.kernels.fp8_quant import fp8_quantize, fp8_row_scale
from gemma4opt.kernels.skinny_linear import TUNERS, _offered, _out, bench_short, k_range, row_dot_tile

MAX_ROWS = 32
# QUANT's amax pass reads x in tiles of this many elements (rows x columns): at one row 2048 columns.
_AMAX_TILE = tl.constexpr(2048)
# The interpreter (CPU tests) runs one config, a while loop for K, and fp32 dot tiles (as in
# skinny_linear; fp8 values are exact in fp32, so the products are the same).
_INTERPRETER_SPLIT = 2      # the one config the interpreter runs for 2+ rows (tests may change it)


@triton.jit
def _k_tile(acc, X, w_rows, k0, K, nmask, m, mmask, sxm, xs,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, COMPILED: tl.constexpr, SWAP: tl.constexpr,
            QUANT: tl.constexpr):
    """acc += x_q[:, k0:k0+BLOCK_K] @ W_q[rows, k0:k0+BLOCK_K]^T in fp32 (SWAP: its transpose). QUANT:
    x is the unquantized input, its tile quantized here with the rows' scales xs (the same bytes as
    quantize_rows writes)."""
    if BLOCK_M == 1 and not QUANT:
        acc = row_dot_tile(acc, X, w_rows, k0, K, nmask, BLOCK_K)
    elif BLOCK_M == 1:          # row_dot_tile's sum on the tile quantized here
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        a = fp8_quantize(tl.load(X + k, mask=kmask, other=0.0).to(tl.float32), xs)
        acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], 1)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(X + m[:, None] * sxm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if QUANT:
            x = fp8_quantize(x.to(tl.float32), xs[:, None])
        if not COMPILED:
            x, w = x.to(tl.float32), w.to(tl.float32)
        # max_num_imprecise_acc=32: each fp8 wgmma (K = 32 per instruction) adds its partial to the
        # fp32 accumulator. Triton's sm_90 default (2^30) keeps the whole K loop in the MMA's own
        # accumulator, which adds with fewer bits than fp32 (DeepSeek-V3 measured ~14; 2.5e-4 relative
        # at K = 72 on the H200); 0 would make Triton upcast to fp16 mma.sync. BLOCK_K >= 32 always.
        if SWAP:
            acc += tl.dot(w, tl.trans(x), max_num_imprecise_acc=32)
        else:
            acc += tl.dot(x, tl.trans(w), max_num_imprecise_acc=32)
    return acc


@triton.jit
def _row_scales(X, m, mmask, sxm, K, BLOCK_M: tl.constexpr, AMAX_K: tl.constexpr, COMPILED: tl.constexpr):
    """The fp8 scales of x's rows m (fp8_row_scale of each row's amax over all of K; one scalar at
    BLOCK_M == 1): every program reads the whole rows again, from L2, before its first tile."""
    amax = tl.zeros([BLOCK_M], tl.float32)
    if COMPILED:
        for k0 in tl.range(0, K, AMAX_K):
            k = k0 + tl.arange(0, AMAX_K)
            x = tl.load(X + m[:, None] * sxm + k[None, :], mask=mmask[:, None] & (k < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
    else:                   # the interpreter takes no runtime range() bound
        k0 = 0
        while k0 < K:
            k = k0 + tl.arange(0, AMAX_K)
            x = tl.load(X + m[:, None] * sxm + k[None, :], mask=mmask[:, None] & (k < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
            k0 += AMAX_K
    scale = fp8_row_scale(amax)
    if BLOCK_M == 1:
        scale = tl.max(scale, 0)
    return scale


@triton.jit
def _fp8_linear_kernel(X, XS, W, WS, Y, P, M, N, K, sxm, swn, sym, ROWS,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, COMPILED: tl.constexpr, SWAP: tl.constexpr = False,
                       PDL: tl.constexpr = False, CAP: tl.constexpr = 0.0, PIPE: tl.constexpr = 0,
                       QUANT: tl.constexpr = False, PARTS=None, NPARTS=1, FROM_PARTS: tl.constexpr = False):
    # ROWS (the row class: 1, 16 or 32) is not read: it keys the autotuner's choice per class.
    # PIPE: the row sums' K loop pipelined in PIPE stages (kernels/skinny_linear.py's _ROW_PIPE).
    # QUANT: X is the unquantized input (bf16 / fp16 / fp32), quantized per row here; the first
    # program writes the scales to XS, where the split sum reads them. FROM_PARTS (one row): the row's
    # amax is the max of PARTS[0:NPARTS], written by the kernel that made X, instead of a pass over X.
    pdl_prologue(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_rows = W + n.to(tl.int64)[:, None] * swn
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    sk = tl.program_id(1)
    lo, hi = k_range(K, SPLIT_K, BLOCK_K)
    xs = 0.0
    if QUANT:
        if FROM_PARTS:
            xs = _parts_scale(PARTS, NPARTS, m, BLOCK_M, COMPILED)
        else:
            xs = _row_scales(X, m, mmask, sxm, K, BLOCK_M, _AMAX_TILE // BLOCK_M, COMPILED)
        if (tl.program_id(0) == 0) & (sk == 0):
            if BLOCK_M == 1:
                tl.store(XS, xs)
            else:
                tl.store(XS + m, xs, mask=mmask)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], tl.float32)
    elif SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if COMPILED:
        for k0 in tl.range(lo, hi, BLOCK_K, num_stages=PIPE if PIPE > 0 else None):
            acc = _k_tile(acc, X, w_rows, k0, hi, nmask, m, mmask, sxm, xs, BLOCK_M, BLOCK_K, COMPILED, SWAP, QUANT)
    else:           # the interpreter takes no runtime range() bound
        k0 = lo
        while k0 < hi:
            acc = _k_tile(acc, X, w_rows, k0, hi, nmask, m, mmask, sxm, xs, BLOCK_M, BLOCK_K, COMPILED, SWAP, QUANT)
            k0 += BLOCK_K
    ws = tl.load(WS + n, mask=nmask, other=0.0)
    if BLOCK_M == 1:
        if not QUANT:
            xs = tl.load(XS)
        y = acc * xs * ws
        tl.store(Y + n, _out(y, Y.dtype.element_ty, CAP), mask=nmask)
    else:
        if not QUANT:
            xs = tl.load(XS + m, mask=mmask, other=0.0)
        if SWAP:        # acc is [BLOCK_N, BLOCK_M]
            mo, no = m[None, :], n[:, None]
            xs2, ws2 = xs[None, :], ws[:, None]
        else:
            mo, no = m[:, None], n[None, :]
            xs2, ws2 = xs[:, None], ws[None, :]
        omask = (mo < M) & (no < N)
        if SPLIT_K == 1:
            tl.store(Y + mo * sym + no, _out(acc * xs2 * ws2, Y.dtype.element_ty, CAP), mask=omask)
        else:           # unscaled fp32 partial of split sk: P[sk, m, n], contiguous [SPLIT_K, M, N]
            tl.store(P + (sk * M + mo).to(tl.int64) * N + no, acc, mask=omask)


@triton.jit
def _split_sum_kernel(P, XS, WS, Y, M, N, sym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                      CAP: tl.constexpr):
    """Y[m, n] = (sum over splits of P[s, m, n], in split order) * x_scale[m] * w_scale[n]."""
    pdl_prologue(PDL)
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + (s * M + m).to(tl.int64) * N + n, mask=nmask, other=0.0)
    y = acc * tl.load(XS + m) * tl.load(WS + n, mask=nmask, other=0.0)
    tl.store(Y + m * sym + n, _out(y, Y.dtype.element_ty, CAP), mask=nmask)


@triton.jit
def _parts_scale(PARTS, NPARTS, m, BLOCK_M: tl.constexpr, COMPILED: tl.constexpr):
    """One row's fp8 scale from the partial amaxes its producer wrote (each >= 0): row 0's at
    BLOCK_M > 1 (the padded rows' scale is SCALE_MIN; they quantize zeros), a scalar at BLOCK_M == 1."""
    amax = tl.zeros([], tl.float32)
    if COMPILED:
        for p0 in tl.range(0, NPARTS, _AMAX_TILE):
            p = p0 + tl.arange(0, _AMAX_TILE)
            amax = tl.maximum(amax, tl.max(tl.load(PARTS + p, mask=p < NPARTS, other=0.0), 0))
    else:                   # the interpreter takes no runtime range() bound
        p0 = 0
        while p0 < NPARTS:
            p = p0 + tl.arange(0, _AMAX_TILE)
            amax = tl.maximum(amax, tl.max(tl.load(PARTS + p, mask=p < NPARTS, other=0.0), 0))
            p0 += _AMAX_TILE
    if BLOCK_M == 1:
        scale = fp8_row_scale(amax)
    else:
        scale = fp8_row_scale(tl.where(m == 0, amax, 0.0))
    return scale


# (BLOCK_N, BLOCK_K, warps, splits, stages): the row-sum tiles (one row) and the tl.dot tiles (W rows
# as the dot's M side), from benchmarks/sweep_fp8_linear.py on an H200 (the 31b's and e4b's decode
# GEMMs and lm_head, each call streaming its weight from HBM): each is among the five best of some
# shape. At one row the dot tiles, the row padded to 16, beat the row sums on the 31b's o_proj, down
# and q/k/v (sm_90 converts e4m3 to fp32 at a rate that caps a row sum near 3.7 TB/s; the MMA takes
# e4m3 as it is), the row sums won the lm_head and the e4b's narrow GEMMs: both stay candidates.
_ROW_SUM = [(8, 2048, 4, 1, 3), (16, 512, 4, 1, 3), (8, 512, 4, 1, 3), (4, 1024, 4, 1, 3), (4, 2048, 8, 1, 3),
            (4, 2048, 4, 1, 3), (8, 2048, 8, 1, 3)]
# The row sums with their K loop pipelined, `stages` deep (PIPE; why: kernels/skinny_linear.py's _ROW_PIPE).
ROW_SUM_PIPE = [(8, 512, 4, 1, 3), (16, 512, 4, 1, 3), (4, 1024, 4, 1, 3), (8, 1024, 4, 1, 3), (8, 2048, 4, 1, 3)]
_DOT = [(64, 256, 4, 1, 3), (64, 256, 4, 1, 4), (128, 256, 8, 1, 4), (128, 128, 8, 1, 4), (64, 128, 4, 1, 4),
        (64, 128, 4, 2, 3), (64, 256, 4, 2, 4), (64, 128, 4, 4, 4), (64, 256, 4, 4, 3), (64, 256, 4, 4, 4)]
MAX_SPLIT = 4


def _configs():
    """Autotune configs, BLOCK_M among their parameters: 1 (row sum) or 16 for one row, 16 for 2-16
    rows, 32 for 17-32, each row class's set picked by the prune below from the ROWS key."""
    out = [triton.Config(dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, SWAP=False), num_warps=w, num_stages=st)
           for bn, bk, w, _, st in _ROW_SUM]
    out += [triton.Config(dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, SWAP=False, PIPE=st), num_warps=w,
                          num_stages=st) for bn, bk, w, _, st in ROW_SUM_PIPE]
    out += [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, SWAP=True), num_warps=w, num_stages=st)
            for bm in (16, 32) for bn, bk, w, sk, st in _DOT]
    return out


def _keep(configs, named_args, **kwargs):
    rows = named_args["ROWS"]
    want = (1, 16) if rows == 1 else (16,) if rows <= 16 else (32,)
    return [c for c in configs if c.kwargs["BLOCK_M"] in want and pipe_offered(c, named_args["K"])]


def pipe_offered(c, K: int) -> bool:
    """Whether config c is offered at K: a pipelined one (PIPE) only while use_tiles offers them and
    over more than one K tile."""
    return not c.kwargs.get("PIPE") or (_offered["pipelined"] and c.kwargs["BLOCK_K"] < K)


def _sum_splits(nargs, exception=None):
    """The split sum after a split config's kernel (also as the autotuner's post-hook, so a split
    config pays for its second kernel when configs are compared)."""
    if exception is None and nargs["SPLIT_K"] > 1:
        M, N, y = nargs["M"], nargs["N"], nargs["Y"]
        _split_sum_kernel[(M, triton.cdiv(N, 512))](nargs["P"], nargs["XS"], nargs["WS"], y, M, N, y.stride(0),
                                                     SPLIT_K=nargs["SPLIT_K"], BLOCK=512, CAP=nargs.get("CAP", 0.0),
                                                     **pdl_flags(y))


_tuned = triton.autotune(configs=_configs(), key=["N", "K", "ROWS", "QUANT", "FROM_PARTS"], do_bench=bench_short, post_hook=_sum_splits,
                         prune_configs_by={"early_config_prune": _keep})(_fp8_linear_kernel)
TUNERS.append(_tuned)


def fp8_linear_triton(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, config: dict | None = None, cap: float | None = None) -> torch.Tensor:
    """x_fp8 [..., K] (at most MAX_ROWS rows) with fp32 scales [...], w_fp8 [N, K] (unit stride along
    K) with fp32 scales [N] -> [..., N] in out_dtype. With ``cap``, the logit softcap tanh(y / cap) * cap
    as the epilogue (an fp8 lm_head), rounded as HF's eager code rounds. ``config`` runs one tile instead of the
    autotuned one: BLOCK_N, BLOCK_K, and optionally SPLIT_K, SWAP, num_warps, num_stages, and
    BLOCK_M (16 or 32 runs one row through the tl.dot path, padded and masked)."""
    x2 = rows_view(x_fp8)
    if x_scale.numel() != x2.shape[0]:
        raise ValueError(f"gemma4opt fp8_linear: scales of {x_scale.numel()} rows for {x2.shape[0]} rows of x")
    xs = x_scale.reshape(x2.shape[0]).float().contiguous()
    return _launch(x2, xs, w_fp8, w_scale, out_dtype, config, cap, False).view(*x_fp8.shape[:-1], w_fp8.shape[0])


def quant_fp8_linear_triton(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
                            config: dict | None = None, amax_parts: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear_triton(*quantize_rows(x), w_fp8, w_scale, out_dtype) in one launch (two with split K):
    each program takes the rows' scales from a pass over all of x (L2) and quantizes each tile of x as
    it reads it, the bytes quantize_rows writes. x [..., K] (at most MAX_ROWS rows, unit stride along K)
    in a float dtype; ``config`` as fp8_linear_triton's. ``amax_parts`` (one row only): fp32 values whose
    max is x's amax (the producer's per-program maxima of |x|), read instead of x for the scale."""
    x2 = rows_view(x)
    if not x.is_floating_point() or x.dtype == torch.float8_e4m3fn:
        raise ValueError(f"gemma4opt quant_fp8_linear: x is {x.dtype}, not an unquantized float tensor")
    if amax_parts is not None and (x2.shape[0] != 1 or amax_parts.dtype != torch.float32 or not amax_parts.numel()):
        raise ValueError(f"gemma4opt quant_fp8_linear: amax_parts ({amax_parts.dtype}, {amax_parts.numel()} values) "
                         f"for {x2.shape[0]} rows: one row and at least one fp32 value")
    xs = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    return _launch(x2, xs, w_fp8, w_scale, out_dtype, config, None, True,
                   amax_parts).view(*x.shape[:-1], w_fp8.shape[0])


def _launch(x2, xs, w_fp8, w_scale, out_dtype, config, cap, quant: bool, parts=None) -> torch.Tensor:
    """The GEMM of x2 [M, K] (fp8 with scales xs, or QUANT: unquantized, xs the scales' output) -> [M, N]."""
    M, K = x2.shape
    N = w_fp8.shape[0]
    what = "quant_fp8_linear" if quant else "fp8_linear"
    if M > MAX_ROWS:
        raise ValueError(f"gemma4opt {what}: {M} rows, at most {MAX_ROWS} (use torch._scaled_mm)")
    if w_fp8.shape[1] != K or w_fp8.stride(1) != 1:
        raise ValueError(f"gemma4opt {what}: weight {tuple(w_fp8.shape)} (stride {w_fp8.stride()}) "
                         f"does not match x [..., {K}] with unit stride along K")
    if w_scale.numel() != N:
        raise ValueError(f"gemma4opt {what}: scales of {w_scale.numel()} channels for a [{N}, {K}] weight")
    ws = w_scale.reshape(N).float().contiguous()
    y = torch.empty(M, N, dtype=out_dtype, device=x2.device)
    if M and N:
        bm = 1 if M == 1 else 16 if M <= 16 else 32
        if config is not None and "BLOCK_M" in config:
            config = dict(config)
            bm = config.pop("BLOCK_M")
            if bm not in (1, 16, 32) or bm < M:
                raise ValueError(f"gemma4opt {what}: BLOCK_M={bm} for {M} rows (1, 16 or 32, at least the rows)")
        # Room for the most splits (a one-row dot tile may split too).
        part = torch.empty(MAX_SPLIT * M * N, dtype=torch.float32, device=x2.device)
        args = (x2, xs, w_fp8, ws, y, part, M, N, K, x2.stride(0), w_fp8.stride(0), y.stride(0), bm)
        flags = dict(COMPILED=_COMPILED, CAP=float(cap or 0.0), QUANT=quant, **pdl_flags(y))
        if parts is not None:
            flags.update(PARTS=parts.contiguous(), NPARTS=parts.numel(), FROM_PARTS=True)
        if config is None and not _COMPILED:
            bn, split = (4, 1) if bm == 1 else (16, _INTERPRETER_SPLIT)
            config = dict(BLOCK_N=bn, BLOCK_K=32, SPLIT_K=split)
        if config is None:
            _tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](*args, **flags)
            split = _tuned.best_config.kwargs["SPLIT_K"]
        else:
            meta = {**dict(SPLIT_K=1, SWAP=False, num_warps=4, num_stages=3), **config}
            split = meta["SPLIT_K"] if bm > 1 else 1
            if split > MAX_SPLIT or (meta["SWAP"] and bm == 1):
                raise ValueError(f"gemma4opt {what}: config {config} (at most {MAX_SPLIT} splits; "
                                 f"SWAP needs 2+ rows)")
            meta.update(SPLIT_K=split, BLOCK_M=bm)
            _fp8_linear_kernel[(triton.cdiv(N, meta["BLOCK_N"]), split)](*args, **meta, **flags)
        _sum_splits(dict(P=part, XS=xs, WS=ws, Y=y, M=M, N=N, SPLIT_K=split, CAP=flags["CAP"]))
    return y
