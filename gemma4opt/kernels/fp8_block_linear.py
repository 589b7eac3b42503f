"""Triton block-scaled FP8 GEMM: transformers' FineGrainedFP8 linears (ops/fp8_block.py's semantics)
with the activations' quantization inside the GEMM.

x [M, K] comes in its own dtype. Each K tile is one activation group (BLOCK_K == the checkpoint's
block_k), so the program that loads a tile of x has the whole group: it takes each row's amax over
it, quantizes the tile to e4m3 in registers (as kernels/fp8_quant.py rounds), multiplies it with
the weight's e4m3 tile (Hopper's fp8 warpgroup MMA, each instruction's partial promoted to fp32)
and adds the product times the row's group scale and each output row's tile scale
(``weight_scale_inv[n // block_n, k // block_k]``) to an fp32 accumulator. No separate quant kernel
and no fp8 copy of x: at decode x is a few kB that every program reads anyway; in a prefill the
re-quantization per N tile is 1 / BLOCK_N of the MMA's work.

Row classes: 1-16 rows (padded to 16) and 17-32 take W's rows as the dot's M side (SWAP, as
kernels/fp8_linear.py), optionally split along K in whole groups (fp32 partials summed in split
order by skinny_linear's split-sum kernel); more rows take 64-128-row tiles of x. One row may also
take FMA tiles (BLOCK_M 1, ``_group_row``: no padding, several groups an iteration). The tile is
autotuned per (N, K, block_n, row class) on the first call.

MoE pairs (``fp8_block_pairs_triton``, transformers' FP8Experts at decode): one (token, expert) pair a
program, its weight and scales found through the expert index (TOPK > 0); a stack that transformers
left in the model's dtype runs the same tiles without the quantization and scales (FP8_W=False).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import COMPILED as _COMPILED, pdl_flags, pdl_prologue, rows_view
from gemma4opt.kernels.fp8_quant import fp8_quantize, fp8_row_scale
from gemma4opt.kernels.skinny_linear import _sum_splits, bench_short, k_range

MAX_SPLIT = 16      # K splits a config may take (bench_kernels' tile sweep's; the autotuned decode tiles')
BLOCK_KS = (32, 64, 128, 256)       # the checkpoint block_k values the kernel takes (one K tile each)
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)     # weight_scale_inv: fp32, or UE8M0 (powers of two)


def _scales(w_scale_inv: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The tile scales as the kernel reads them: fp32, or UE8M0's bytes (E8M0) as uint8."""
    ws = w_scale_inv.contiguous()
    e8m0 = ws.dtype == torch.float8_e8m0fnu
    return (ws.view(torch.uint8) if e8m0 else ws), e8m0


@triton.jit
def _group_tile(acc, X, w_rows, s_rows, k0, K, nmask, m, mmask, sxm,
                BLOCK_K: tl.constexpr, COMPILED: tl.constexpr, SWAP: tl.constexpr, FP8_W: tl.constexpr,
                E8M0: tl.constexpr):
    """acc += (quantized x group [m, k0:k0+BLOCK_K]) @ W_q[rows, group]^T * both scales (SWAP: transposed).
    FP8_W=False: a weight transformers left in the model's dtype, x @ W^T as it is (F.linear's math)."""
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    xmask = mmask[:, None] & kmask[None, :]
    w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    if FP8_W:
        x = tl.load(X + m[:, None] * sxm + k[None, :], mask=xmask, other=0.0).to(tl.float32)
        xs = fp8_row_scale(tl.max(tl.abs(x), axis=1))              # [BLOCK_M]: masked lanes are 0
        xq = fp8_quantize(x, xs[:, None])
        ws = tl.load(s_rows + k0 // BLOCK_K, mask=nmask, other=0)     # [BLOCK_N]
        if E8M0:                # UE8M0 scales (scale_fmt="ue8m0"): the byte b is 2^(b - 127)
            ws = tl.exp2(ws.to(tl.float32) - 127.0)
        if not COMPILED:        # the interpreter's dot takes fp32 (e4m3 values are exact in it)
            xq, w = xq.to(tl.float32), w.to(tl.float32)
        # max_num_imprecise_acc=32: kernels/fp8_linear.py's _k_tile says why (a K = 32 wgmma's partial
        # goes to fp32 at once).
        if SWAP:
            acc += tl.dot(w, tl.trans(xq), max_num_imprecise_acc=32) * ws[:, None] * xs[None, :]
        else:
            acc += tl.dot(xq, tl.trans(w), max_num_imprecise_acc=32) * xs[:, None] * ws[None, :]
    else:
        x = tl.load(X + m[:, None] * sxm + k[None, :], mask=xmask, other=0.0)
        # ieee: an fp32 model's stack multiplied in fp32 as F.linear does (not TF32)
        if SWAP:
            acc += tl.dot(w, tl.trans(x), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    return acc


@triton.jit
def _group_row(acc, x_row, w_rows, s_rows, k0, K, nmask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUPS: tl.constexpr, FP8_W: tl.constexpr, E8M0: tl.constexpr):
    """One row (BLOCK_M == 1) without the MMA: acc [BLOCK_N, GROUPS] += each of the row's GROUPS groups
    from k0, quantized and dotted with W's rows in fp32 FMAs, scaled as _group_tile scales. A decode
    row takes no 16-row padding and a program reads many groups an iteration (the per-channel GEMM's
    fastest one-row tiles read 2048 of K at a time); the sum over the groups waits for the loop's end,
    so an iteration reduces only within groups. FP8_W=False: F.linear's products, summed alike."""
    k = k0 + tl.arange(0, GROUPS * BLOCK_K)
    kmask = k < K
    w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
    x = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
    if FP8_W:
        xg = tl.reshape(x, [GROUPS, BLOCK_K])
        xs = fp8_row_scale(tl.max(tl.abs(xg), axis=1))                 # [GROUPS]: masked groups' are unread
        xq = tl.reshape(fp8_quantize(xg, xs[:, None]).to(tl.float32), [GROUPS * BLOCK_K])  # exact in fp32
        part = tl.sum(tl.reshape(w * xq[None, :], [BLOCK_N, GROUPS, BLOCK_K]), 2)
        g = k0 // BLOCK_K + tl.arange(0, GROUPS)
        ws = tl.load(s_rows[:, None] + g[None, :], mask=nmask[:, None] & (g * BLOCK_K < K)[None, :], other=0)
        if E8M0:
            ws = tl.exp2(ws.to(tl.float32) - 127.0)
        acc += part * ws * xs[None, :]
    else:
        acc += tl.sum(tl.reshape(w * x[None, :], [BLOCK_N, GROUPS, BLOCK_K]), 2)
    return acc


@triton.jit
def _k_step(acc, X, row, w_rows, s_rows, k0, K, nmask, m, mmask, sxm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, GROUPS: tl.constexpr, COMPILED: tl.constexpr, SWAP: tl.constexpr,
            FP8_W: tl.constexpr, E8M0: tl.constexpr):
    """One iteration of the K loop: GROUPS groups of the program's row (BLOCK_M 1), else one group of its tile."""
    if BLOCK_M == 1:
        acc = _group_row(acc, X + row * sxm, w_rows, s_rows, k0, K, nmask, BLOCK_N, BLOCK_K, GROUPS, FP8_W, E8M0)
    else:
        acc = _group_tile(acc, X, w_rows, s_rows, k0, K, nmask, m, mmask, sxm, BLOCK_K, COMPILED, SWAP, FP8_W, E8M0)
    return acc


@triton.jit
def _fp8_block_linear_kernel(X, W, WS, Y, P, IDX, M, N, K, sxm, swn, swsn, sym, swe, swse, ROWS, BN_W: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SPLIT_K: tl.constexpr, COMPILED: tl.constexpr, SWAP: tl.constexpr = False,
                             PDL: tl.constexpr = False, TOPK: tl.constexpr = 0, FP8_W: tl.constexpr = True,
                             E8M0: tl.constexpr = False, GROUPS: tl.constexpr = 1):
    # ROWS (the row class) is not read: it keys the autotuner's choice. BN_W: the checkpoint's block_n.
    # TOPK > 0: MoE (token, expert) pairs, one a program (program_id(2)): pair p multiplies x's row
    # p // TOPK by expert IDX[p]'s weight (W and WS strided by swe, swse per expert) into Y's row p.
    # BLOCK_M == 1: one row a program (program_id(2)) by _group_row, GROUPS groups an iteration (the
    # MMA's tiles take one).
    pdl_prologue(PDL)
    if TOPK > 0:
        p = tl.program_id(2).to(tl.int64)
        e = tl.load(IDX + p).to(tl.int64)
        W += e * swe
        WS += e * swse
        X += (p // TOPK) * sxm
        Y += p * sym
        M = 1           # this program's one row (at X and Y, moved above)
        m = tl.arange(0, BLOCK_M)
        row = 0
    else:
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        row = tl.program_id(2).to(tl.int64)     # (BLOCK_M == 1: the program's row)
    mmask = m < M
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_rows = W + n.to(tl.int64)[:, None] * swn
    s_rows = WS + (n // BN_W) * swsn
    lo, hi = k_range(K, SPLIT_K, BLOCK_K * GROUPS)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, GROUPS], tl.float32)
    elif SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if COMPILED:
        for k0 in range(lo, hi, BLOCK_K * GROUPS):
            acc = _k_step(acc, X, row, w_rows, s_rows, k0, hi, nmask, m, mmask, sxm, BLOCK_M, BLOCK_N, BLOCK_K,
                          GROUPS, COMPILED, SWAP, FP8_W, E8M0)
    else:           # the interpreter takes no runtime range() bound
        k0 = lo
        while k0 < hi:
            acc = _k_step(acc, X, row, w_rows, s_rows, k0, hi, nmask, m, mmask, sxm, BLOCK_M, BLOCK_N, BLOCK_K,
                          GROUPS, COMPILED, SWAP, FP8_W, E8M0)
            k0 += BLOCK_K * GROUPS
    if BLOCK_M == 1:
        y = tl.sum(acc, 1)
        if SPLIT_K == 1:
            tl.store(Y + row * sym + n, y.to(Y.dtype.element_ty), mask=nmask)
        else:       # P[sk, row, n]
            tl.store(P + (tl.program_id(1) * M + row).to(tl.int64) * N + n, y, mask=nmask)
    else:
        if SWAP:
            mo, no = m[None, :], n[:, None]
        else:
            mo, no = m[:, None], n[None, :]
        omask = (mo < M) & (no < N)
        if SPLIT_K == 1:
            tl.store(Y + mo * sym + no, acc.to(Y.dtype.element_ty), mask=omask)
        else:           # the scaled fp32 partial of split sk: P[sk, m, n], contiguous [SPLIT_K, M, N]
            tl.store(P + (tl.program_id(1) * M + mo).to(tl.int64) * N + no, acc, mask=omask)


# Decode (BLOCK_N, warps, splits, stages), each at BLOCK_M 16 and 32 (32 rows: up to DECODE_SPLIT_32 splits);
# prefill (BLOCK_M, BLOCK_N, warps, stages). BLOCK_K is the checkpoint's block_k. The decode tiles are
# bench_kernels.py --sweep-fp8-block's fastest at the e4b's GEMMs at 1 and 8 rows on an H100: 128 W rows
# and 8 warps a program, K in 4-16 splits (each program's K loop runs its groups one after another,
# quantizing x's, so a long loop is slow: 1-4 splits were 2-4x slower at the MLP's down projection).
# The 256-row tiles (8-16 warps) were the H200 sweep's fastest at 8 rows at 5 of the e4b's 6 GEMMs
# (the best 128-row tile 1.02-1.08x their time, at gate_up 1.18x or more; not yet timed end to end).
# The 64-row tiles stay for the MoE pairs (unsplit) and narrow N.
# The prefill tiles are those that compile for sm_90 at 128 x 128 blocks without spilling registers
# (the quantized x tile lives in them: 128 x 128 rows spill 44-1552 bytes).
_DECODE = [(128, 8, 1, 3), (128, 8, 2, 3), (128, 8, 4, 3), (128, 8, 8, 3), (128, 8, 16, 3), (128, 8, 16, 4),
           (256, 16, 4, 3), (256, 16, 8, 3), (256, 8, 16, 3), (256, 16, 16, 3),
           (64, 4, 1, 3), (64, 4, 1, 4), (64, 4, 16, 3)]
# One row (a batch-1 decode step, a MoE pair): (BLOCK_N, GROUPS, warps, splits, stages) of _group_row's
# FMA tiles, beside the MMA's 16-row ones (the autotuner takes the faster): 8-16 W rows, 4-16 groups an
# iteration, K unsplit or halved, the fastest at each of the e4b's GEMMs in bench_kernels.py
# --sweep-fp8-block on the H200 (1.0-1.5x faster there than the autotuner's pick among the tiles first
# listed here; not yet timed end to end).
_ROW = [(8, 4, 4, 1, 3), (8, 4, 4, 2, 3), (16, 4, 4, 1, 3), (16, 4, 4, 2, 3), (8, 16, 4, 1, 3), (8, 8, 4, 2, 3),
        (4, 16, 4, 1, 3), (8, 8, 8, 1, 3)]
_TUNED_SPLIT = max(t[2] for t in _DECODE)
DECODE_SPLIT_32 = 4
_PREFILL = [(64, 128, 4, 3), (64, 128, 8, 3), (64, 128, 8, 4), (64, 64, 4, 4), (128, 64, 8, 3)]


def _configs():
    out = [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=sk, SWAP=True), num_warps=w, num_stages=st)
           for bm in (16, 32) for bn, w, sk, st in _DECODE]
    out += [triton.Config(dict(BLOCK_M=1, BLOCK_N=bn, GROUPS=g, SPLIT_K=sk), num_warps=w, num_stages=st)
            for bn, g, w, sk, st in _ROW]
    out += [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1, SWAP=False), num_warps=w, num_stages=st)
            for bm, bn, w, st in _PREFILL]
    return out


def _keep(configs, named_args, **kwargs):
    rows = named_args["ROWS"]
    if rows == 0:       # MoE pairs: one row a program, unsplit
        return [c for c in configs if c.kwargs["BLOCK_M"] in (1, 16) and c.kwargs["SPLIT_K"] == 1]
    if rows > 32:
        return [c for c in configs if c.kwargs["BLOCK_M"] > 32]
    want = (1, 16) if rows == 1 else (rows,)
    return [c for c in configs if c.kwargs["BLOCK_M"] in want and c.kwargs["SPLIT_K"] <= tuned_splits(rows)]


_tuned = triton.autotune(configs=_configs(), key=["N", "K", "ROWS", "BN_W", "BLOCK_K", "FP8_W"], do_bench=bench_short,
                         post_hook=_sum_splits,
                         prune_configs_by={"early_config_prune": _keep})(_fp8_block_linear_kernel)


def row_class(M: int) -> int:
    return 1 if M == 1 else 16 if M <= 16 else 32 if M <= 32 else 64


def tuned_splits(M: int) -> int:
    """The most K splits an autotuned tile takes at M rows (the fp32 partials' buffer is that many M x N:
    fewer at 17-32 rows)."""
    return _TUNED_SPLIT if M <= 16 else DECODE_SPLIT_32 if M <= 32 else 1


def fp8_block_linear_triton(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, block_n: int,
                            block_k: int, config: dict | None = None) -> torch.Tensor:
    """x [..., K] (bf16, fp16 or fp32), w_fp8 [N, K] e4m3 (unit stride along K) with its fp32 tile
    scales [ceil(N / block_n), ceil(K / block_k)] -> [..., N] in x's dtype. ``config`` runs one tile
    instead of the autotuned one: BLOCK_M, BLOCK_N, and optionally SPLIT_K, SWAP, GROUPS (BLOCK_M 1),
    num_warps, num_stages."""
    x2 = rows_view(x)
    M, K = x2.shape
    N = w_fp8.shape[0]
    if block_k not in BLOCK_KS:
        raise ValueError(f"gemma4opt fp8_block_linear: block_k={block_k}; the kernel takes {BLOCK_KS}")
    if w_fp8.shape[1] != K or w_fp8.stride(1) != 1:
        raise ValueError(f"gemma4opt fp8_block_linear: weight {tuple(w_fp8.shape)} (stride {w_fp8.stride()}) "
                         f"does not match x [..., {K}] with unit stride along K")
    grid_s = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    if tuple(w_scale_inv.shape) != grid_s or w_scale_inv.dtype not in SCALE_DTYPES:
        raise ValueError(f"gemma4opt fp8_block_linear: weight_scale_inv {tuple(w_scale_inv.shape)} "
                         f"{w_scale_inv.dtype} for a [{N}, {K}] weight in ({block_n}, {block_k}) blocks: "
                         f"want {grid_s} float32 or float8_e8m0fnu")
    ws, e8m0 = _scales(w_scale_inv)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        splits = tuned_splits(M) if config is None else config.get("SPLIT_K", 1)     # (checked below)
        part = torch.empty(splits * M * N if M <= 32 else 0, dtype=torch.float32, device=x.device)
        args = (x2, w_fp8, ws, y, part, ws, M, N, K, x2.stride(0), w_fp8.stride(0), ws.stride(0), y.stride(0), 0, 0,
                row_class(M))
        flags = dict(BN_W=block_n, BLOCK_K=block_k, COMPILED=_COMPILED, E8M0=e8m0, **pdl_flags(y))
        if config is None and not _COMPILED:        # the interpreter runs one tile per row class
            config = dict(BLOCK_M=1, BLOCK_N=16, GROUPS=2, SPLIT_K=2) if M == 1 else \
                dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=2, SWAP=True) if M <= 16 else dict(BLOCK_M=64, BLOCK_N=16)
        if config is None:
            _tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], triton.cdiv(M, meta["BLOCK_M"]))](
                *args, **flags)
            split = _tuned.best_config.kwargs["SPLIT_K"]
        else:
            meta = {**dict(SPLIT_K=1, SWAP=False, num_warps=4, num_stages=3), **config}
            one_row = meta["BLOCK_M"] == 1      # a program a row: splits at any row count up to 32
            if meta["SPLIT_K"] > MAX_SPLIT or (meta["SPLIT_K"] > 1 and (M > 32 or (meta["BLOCK_M"] < M and not one_row))) \
                    or (meta.get("GROUPS", 1) > 1 and not one_row):
                raise ValueError(f"gemma4opt fp8_block_linear: config {config} (at most {MAX_SPLIT} splits, "
                                 "and only with one program's rows or one row a program, up to 32; GROUPS > 1 "
                                 "only with BLOCK_M 1)")
            grid = (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], triton.cdiv(M, meta["BLOCK_M"]))
            _fp8_block_linear_kernel[grid](*args, **meta, **flags)
            split = meta["SPLIT_K"]
        _sum_splits(dict(P=part, Y=y, M=M, N=N, SPLIT_K=split))
    return y.view(*x.shape[:-1], N)


def fp8_block_pairs_triton(x: torch.Tensor, idx: torch.Tensor, topk: int, w_fp8: torch.Tensor,
                           w_scale_inv: torch.Tensor, block_n: int, block_k: int,
                           config: dict | None = None) -> torch.Tensor:
    """MoE (token, expert) pairs: x [T, K] (or [P, K] with topk=1), idx [P] the expert of each pair
    (P = T * topk, pair p reads x's row p // topk), stacked experts w_fp8 [E, N, K] with tile scales
    [E, ceil(N / block_n), ceil(K / block_k)] -> [P, N] in x's dtype: each pair's row through its
    expert's block-scaled GEMM (one pair a program: its row padded to the MMA's 16, or _group_row's
    FMAs). A stack in x's dtype (transformers leaves one that is not whole blocks unquantized): x @ W^T,
    its scales unread. ``config`` runs one unsplit tile (BLOCK_M 1 or 16) instead of the autotuned one."""
    E, N, K = w_fp8.shape
    P = idx.numel()
    fp8 = w_fp8.dtype == torch.float8_e4m3fn
    if block_k not in BLOCK_KS or x.shape[-1] != K or w_fp8.stride(-1) != 1 or x.stride(-1) != 1 or \
            not (fp8 or w_fp8.dtype == x.dtype):
        raise ValueError(f"gemma4opt fp8_block_pairs: x {tuple(x.shape)} {x.dtype}, experts {tuple(w_fp8.shape)} "
                         f"{w_fp8.dtype} (block_k {block_k}: the kernel takes {BLOCK_KS}, unit strides along K)")
    want = (E, triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    if (fp8 and (tuple(w_scale_inv.shape) != want or w_scale_inv.dtype not in SCALE_DTYPES)) or x.shape[0] * topk != P:
        raise ValueError(f"gemma4opt fp8_block_pairs: scales {tuple(w_scale_inv.shape)} {w_scale_inv.dtype}, "
                         f"{P} pairs of {x.shape[0]} rows x top-{topk}")
    # (a stack in x's dtype reads no scales: any fp32 tensor of 3 dims stands in)
    ws, e8m0 = _scales(w_scale_inv) if fp8 else (torch.zeros(1, 1, 1, dtype=torch.float32, device=x.device), False)
    idx = idx.reshape(P).contiguous()
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P and N:
        part = torch.empty(0, dtype=torch.float32, device=x.device)     # no splits
        args = (x, w_fp8, ws, y, part, idx, P, N, K, x.stride(0), w_fp8.stride(1), ws.stride(1), y.stride(0),
                w_fp8.stride(0), ws.stride(0), 0)
        flags = dict(BN_W=block_n, BLOCK_K=block_k, COMPILED=_COMPILED, TOPK=topk, FP8_W=fp8, E8M0=e8m0,
                     **pdl_flags(y))
        if config is None and not _COMPILED:        # the interpreter runs one tile
            config = dict(BLOCK_M=16, BLOCK_N=16, SWAP=True)
        if config is None:
            _tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), 1, P)](*args, **flags)
        else:
            meta = {**dict(SWAP=True, num_warps=4, num_stages=3), **config, "SPLIT_K": 1}
            _fp8_block_linear_kernel[(triton.cdiv(N, meta["BLOCK_N"]), 1, P)](*args, **meta, **flags)
    return y
