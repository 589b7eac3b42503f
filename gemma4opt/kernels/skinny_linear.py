"""Triton y = x @ W^T for a few rows (decode: M <= 32), W [N, K] row-major as nn.Linear keeps it.

``gemma4opt.linear`` (ops/linear.py) runs it on the decode shapes where it timed faster than cuBLAS
(``benchmarks/bench_kernels.py --linear`` compares them). Why it can win: at batch 1 the 31b decode step's layer
GEMMs stream their weights at ~3.83 TB/s through cuBLASLt (24 of them per step split K and add a
reduce kernel), while the lm_head, one plain stream, reaches 4.34 (README, batch-1 profile).
Here each program owns BLOCK_N rows of W and walks all of K (at one row always; at 2-32 rows the
autotuner may split K, below): W is read once, in long contiguous runs. The tile shape is autotuned
per (N, K, row class) on the first call, which decode graphs make eagerly before capturing.

M == 1: an fp32 multiply-and-row-sum (tensor cores would idle 15 of 16 rows), K walked in tiles or,
where K fits one (``_WHOLE``), loaded whole in one trip to memory. 2 <= M <= 32:
``tl.dot`` with W's rows as the dot's M side and x's rows (padded to 16 or 32, masked) as its N
side, cuBLAS's own layout for these shapes ("TNT" tiles of 128-192 W rows by 32): a 64-128 row W tile
feeds Hopper's warpgroup MMA, where x-rows-as-M tiles (the first version) ran as low as 0.84x cuBLAS.

Split K (one more autotuned choice at 2-32 rows: 1, 2 or 4 splits, up to 16 for N <= NARROW_N; at one
row 2 or 4 for N <= NARROW_N over K >= ROW_SPLIT_MIN_K): with few W rows per program a narrow GEMM has
too few programs to fill the GPU evenly (the 31b's down_proj). Splits write fp32 partials and a second
kernel sums them in split order (deterministic), as cuBLAS's split-K does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from gemma4opt.kernels._util import COMPILED as _COMPILED, pdl_flags, pdl_prologue, rows_view
from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_rounded
from gemma4opt.kernels.softcap import softcap_rounded

MAX_ROWS = 32
# Triton's interpreter (CPU tests) multiplies bf16 dot tiles as raw integers, takes no runtime
# loop bound and cannot benchmark configs: there tiles go to fp32, the loop is a while loop, and
# one config runs. The compiled kernel keeps the for loop: Triton pipelines the loads that feed
# tl.dot on its own, the row sums' loads only in a loop that asks (PIPE, below).
_INTERPRETER_SPLIT = 2      # the one config the interpreter runs for 2+ rows (tests may change it)


@triton.jit
def row_dot_tile(acc, A, w_rows, k0, K, nmask, BLOCK_K: tl.constexpr):
    """acc[i] += W[row i, k0:k0+BLOCK_K] . a[k0:k0+BLOCK_K] in fp32: one row against many (one
    decode row here; each (token, expert) pair in kernels/moe_experts.py)."""
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    a = tl.load(A + k, mask=kmask, other=0.0)
    return acc + tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], 1)


@triton.jit
def k_range(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[lo, hi) of K that split program_id(1) sums: all of K unsplit (compiled as before split K
    existed, measured on the H200), else whole BLOCK_K tiles, so that only the last tile masks."""
    if SPLIT_K == 1:
        lo = 0
        hi = K
    else:
        chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        lo = tl.program_id(1) * chunk
        hi = tl.minimum(lo + chunk, K)
    return lo, hi


@triton.jit
def _x_tile(X, U, x_off, u_off, mask, GELU: tl.constexpr):
    """The GEMM's input tile; with GELU, gelu_tanh(x) * u made here, rounded exactly as
    kernels/gelu_tanh_mul.py's kernel rounds it (ops/gelu_linear.py: that kernel's launch saved)."""
    x = tl.load(X + x_off, mask=mask, other=0.0)
    if GELU:
        u = tl.load(U + u_off, mask=mask, other=0.0)
        x = (gelu_tanh_rounded(x.to(tl.float32), x.dtype) * u.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _k_tile(acc, X, U, w_rows, k0, K, nmask, m, mmask, sxm, sum_,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, COMPILED: tl.constexpr, IEEE: tl.constexpr,
            SWAP: tl.constexpr, GELU: tl.constexpr):
    """acc += x[:, k0:k0+BLOCK_K] @ W[rows, k0:k0+BLOCK_K]^T (SWAP: its transpose, W rows as the
    dot's M side, so a 64+ row W tile can take Hopper's warpgroup MMA with the few x rows as N)."""
    # One return, at the end (no early return inside a constexpr if).
    if BLOCK_M == 1 and not GELU:
        acc = row_dot_tile(acc, X, w_rows, k0, K, nmask, BLOCK_K)
    elif BLOCK_M == 1:      # row_dot_tile's sum, on the gelu·mul input
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        a = _x_tile(X, U, k, k, kmask, GELU)
        acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], 1)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = _x_tile(X, U, m[:, None] * sxm + k[None, :], m[:, None] * sum_ + k[None, :],
                    mmask[:, None] & kmask[None, :], GELU)
        if not COMPILED:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if SWAP:
            a, b = w, tl.trans(x)
        else:
            a, b = x, tl.trans(w)
        if IEEE:    # fp32 models: exact products (Triton's fp32 dot default is TF32)
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    return acc


@triton.jit
def _out(acc, dt, CAP: tl.constexpr):
    """The GEMM's output in dt; with CAP > 0 the logit softcap tanh(y / CAP) * CAP on it, rounded
    where HF's eager code rounds (the bf16 logits, then after /, tanh and *)."""
    if CAP > 0:
        out = softcap_rounded(acc.to(dt).to(tl.float32), dt, CAP)
    else:
        out = acc.to(dt)
    return out


@triton.jit
def _skinny_kernel(X, U, W, Y, P, M, N, K, sxm, sum_, swn, sym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   COMPILED: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr = False, PDL: tl.constexpr = False,
                   CAP: tl.constexpr = 0.0, GELU: tl.constexpr = False, PIPE: tl.constexpr = 0):
    # GELU: the input is gelu_tanh(X) * U (X, U of one shape; row strides sxm, sum_); else U is unread.
    # PIPE: the one-row tiles' K loop pipelined in PIPE stages (``_ROW_PIPE``).
    pdl_prologue(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_rows = W + n.to(tl.int64)[:, None] * swn
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    sk = tl.program_id(1)
    lo, hi = k_range(K, SPLIT_K, BLOCK_K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], tl.float32)
    elif SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if COMPILED:     # num_stages None: Triton's own choice, the plain range() loop (the same code)
        for k0 in tl.range(lo, hi, BLOCK_K, num_stages=PIPE if PIPE > 0 else None):
            acc = _k_tile(acc, X, U, w_rows, k0, hi, nmask, m, mmask, sxm, sum_, BLOCK_M, BLOCK_K, COMPILED, IEEE,
                          SWAP, GELU)
    else:           # the interpreter takes no runtime range() bound
        k0 = lo
        while k0 < hi:
            acc = _k_tile(acc, X, U, w_rows, k0, hi, nmask, m, mmask, sxm, sum_, BLOCK_M, BLOCK_K, COMPILED, IEEE,
                          SWAP, GELU)
            k0 += BLOCK_K
    if BLOCK_M == 1 and SPLIT_K == 1:
        tl.store(Y + n, _out(acc, Y.dtype.element_ty, CAP), mask=nmask)
    elif BLOCK_M == 1:      # fp32 partial of split sk (row 0 of P[sk, 1, N])
        tl.store(P + sk.to(tl.int64) * N + n, acc, mask=nmask)
    else:
        if SWAP:        # acc is [BLOCK_N, BLOCK_M]
            mo, no = m[None, :], n[:, None]
        else:
            mo, no = m[:, None], n[None, :]
        if SPLIT_K == 1:
            tl.store(Y + mo * sym + no, _out(acc, Y.dtype.element_ty, CAP), mask=(mo < M) & (no < N))
        else:           # fp32 partial of split sk: P[sk, m, n], contiguous [SPLIT_K, M, N]
            tl.store(P + (sk * M + mo).to(tl.int64) * N + no, acc, mask=(mo < M) & (no < N))


@triton.jit
def _split_sum_kernel(P, Y, M, N, sym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                      CAP: tl.constexpr):
    """Y[m, n] = sum over splits of P[s, m, n], in split order."""
    pdl_prologue(PDL)
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + (s * M + m).to(tl.int64) * N + n, mask=nmask, other=0.0)
    tl.store(Y + m * sym + n, _out(acc, Y.dtype.element_ty, CAP), mask=nmask)


# (BLOCK_N, BLOCK_K, warps, splits, stages, SWAP). One row: few W rows per program (many programs,
# even work per SM) and long K runs. 2-32 rows: W rows as the dot's M side (SWAP), 64-128 of them per
# program, unsplit or split in 2 or 4 (narrow GEMMs). ``bench_kernels.py --sweep-linear`` timed 180
# tiles on the 31b's GEMMs at 32 rows on an H200: every shape's five fastest were SWAP tiles, these
# among them; the best beat cuBLAS by 1.13x on o_proj (sliding), 1.05x (full) and 1.03x on down,
# and tied on gate/up and q/k/v. The old x-rows-as-M tiles (the last two) stay for small N.
# Tuned per (N, K, row class): kept short so a warm-up tunes in seconds.
# Two W rows a program: narrow GEMMs (the e4b's per-layer-input gate, 256 x 2560, took 4.8 us at
# 64 programs of 4 rows, where its 1.3 MB need ~0.3) fill more SMs.
_ROW_SUM = [(bn, bk, w, 1, 3, False) for bn in (4, 8, 16) for bk in (512, 1024) for w in (4, 8)]
_ROW_SUM += [(2, 512, 4, 1, 3, False), (2, 1024, 4, 1, 3, False)]
# Whole-K tiles at one row: one or two W rows a program, all of K in one load (one trip to memory
# where the tiles above take K / BLOCK_K dependent-ish trips: latency, not bytes, bounds a small
# GEMM at one row). One stage: the loop runs once. ``_keep`` offers a shape only the one BLOCK_K
# that just covers its K (BLOCK_K / 2 < K <= BLOCK_K): two or three configs more per shape.
WHOLE_K = (2048, 4096, 8192, 16384)
_WHOLE = [(bn, bk, w, 1, 1, False) for bk in WHOLE_K for bn, w in ((1, 4), (1, 8), (2, 8))
          if bk * bn // (32 * w) <= 64]        # at most 64 weight elements a thread: no spills
_DOT = [(64, 128, 4, 1, 3, True), (64, 128, 4, 1, 5, True), (64, 64, 4, 1, 5, True), (128, 64, 8, 1, 3, True),
        (128, 128, 8, 2, 5, True), (64, 128, 4, 2, 3, True), (64, 128, 4, 4, 3, True), (64, 64, 4, 4, 5, True),
        (16, 256, 4, 1, 3, False), (32, 128, 4, 4, 3, False)]
# Narrow GEMMs at 2-32 rows (N <= NARROW_N): 16-32 W rows a program (Ampere-style MMA; a warpgroup
# MMA needs 64) and K split up to 16 ways, and one 64-row tile split 8 ways. With the tiles above an N of 256-3072 is 4-48 programs of
# 64 rows, each walking a long K on one SM: the e4b's per-layer-input gate (256 x 2560) took 6 us at
# 32 rows where its 1.3 MB need 0.3, its q/k/v, o_proj and down 1.5-2.7x their bytes' time, and the
# 26b-a4b's dense MLP and o_proj at 8 rows 1.6-2.1x (profile-presets, PDL off, H200).
NARROW_N = 8192
# Split K at one row, for a narrow N over a long K (N <= NARROW_N, K >= ROW_SPLIT_MIN_K): the e4b's MLP
# down (2560 x 10240) took 15.1-15.5 us at one row, 71 % of its bytes' time, where the gate/up GEMM
# before it (20480 x 2560) reached 84 % (profile_e4b_layers_h200.txt): few programs, each walking a long
# K. Split in 2 or 4, the partials summed by the second kernel as at 2-32 rows.
ROW_SPLIT_MIN_K = 4096
_ROW_SPLIT = [(bn, bk, 4, sk, 3, False) for bn in (4, 8) for bk in (512, 1024) for sk in (2, 4)]
# Pipelined row sums (PIPE = stages): Triton pipelines a loop's loads on its own only where they feed
# tl.dot. Compiled for sm_90, the row-sum loop above loads a tile and sums it before it loads the
# next (plain loads, no cp.async), one trip to memory per tile: a program of the e4b's MLP down
# (K = 10240 in 512-wide tiles) makes 20 in a row. These ask the loop to stage its loads through
# shared memory (cp.async) ``stages`` deep, so that a program keeps tiles in flight while it sums one
# (tests/kernels/test_compiles_for_sm90.py checks both forms). Same loads, same sums, same bits.
_ROW_PIPE = [(4, 512, 4, 1, 3, False), (8, 512, 4, 1, 3, False), (8, 1024, 4, 1, 3, False), (16, 512, 8, 1, 3, False),
             (4, 512, 4, 1, 4, False), (4, 512, 4, 2, 3, False), (8, 512, 4, 4, 3, False)]
_DOT_NARROW = [(16, 128, 4, 8, 3, True), (16, 128, 4, 16, 3, True), (32, 128, 4, 4, 3, True),
               (32, 128, 4, 8, 3, True), (64, 128, 4, 8, 3, True)]
WIDE_SPLIT = max(t[3] for t in _DOT)                  # the most splits a tile offered to N > NARROW_N takes
MAX_SPLIT = max(WIDE_SPLIT, *(t[3] for t in _DOT_NARROW), *(t[3] for t in _ROW_SPLIT))


def max_split(N: int) -> int:
    """The most K splits any tile offered to an N-row weight takes (its fp32 partials' room)."""
    return MAX_SPLIT if N <= NARROW_N else WIDE_SPLIT


def tile_configs(row_sum: list[tuple], dot: list[tuple], whole_k: list[tuple] = (), narrow: list[tuple] = (),
                 row_split: list[tuple] = (), pipelined: list[tuple] = ()):
    """Autotune configs from (BLOCK_N, BLOCK_K, warps, splits, stages, SWAP) tuples, and the prune
    that keeps the row-sum path's configs for one row and tl.dot's for more; ``whole_k`` ones join
    the row-sum configs of a K they cover in one tile, ``narrow`` ones the tl.dot configs of an
    N <= NARROW_N, ``row_split`` ones the row-sum configs of an N <= NARROW_N with K >= ROW_SPLIT_MIN_K,
    ``pipelined`` ones (row sums whose K loop is pipelined in ``stages`` stages: PIPE) those of a K
    longer than their BLOCK_K, split ones only where ``row_split`` ones go (each while ``use_tiles``
    offers them)."""
    def config(t, pipe):
        bn, bk, w, sk, st, swap = t
        return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "SWAP": swap, "PIPE": st if pipe else 0},
                             num_warps=w, num_stages=st)

    plain = dict.fromkeys(row_sum + dot + list(whole_k) + list(narrow) + list(row_split))
    configs = [config(t, False) for t in plain] + [config(t, True) for t in dict.fromkeys(pipelined)]

    def key(c):
        k = c.kwargs
        return k["BLOCK_N"], k["BLOCK_K"], c.num_warps, k["SPLIT_K"], c.num_stages, k["SWAP"], k["PIPE"] > 0

    def keep(configs, named_args, **kwargs):
        bm = kwargs.get("BLOCK_M", named_args.get("BLOCK_M"))
        N, K = named_args["N"], named_args["K"]
        want = set(row_sum if bm == 1 else dot)
        if bm == 1 and _offered["whole_k"]:
            want |= {t for t in whole_k if t[1] // 2 < K <= t[1]}
        if bm == 1 and _offered["row_split"] and row_splits(N, K):
            want |= set(row_split)
        if bm > 1 and _offered["narrow"] and N <= NARROW_N:
            want |= set(narrow)
        want = {(*t, False) for t in want}
        if bm == 1 and _offered["pipelined"]:
            want |= {(*t, True) for t in pipelined if t[1] < K and (t[3] == 1 or row_splits(N, K))}
        return [c for c in configs if key(c) in want] or configs

    return configs, keep


def bench_short(fn, quantiles=None):
    # Short runs: a warm-up tunes every decode GEMM shape (Triton's default spends ~0.13 s a config).
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _sum_splits(nargs, exception=None):
    """Launch the split sum after a split config's kernel; as the autotuner's post-hook it runs
    inside each timed call, so a split config pays for its second kernel when configs are compared."""
    if exception is None and nargs["SPLIT_K"] > 1:
        M, N, y = nargs["M"], nargs["N"], nargs["Y"]
        _split_sum_kernel[(M, triton.cdiv(N, 512))](nargs["P"], y, M, N, y.stride(0), SPLIT_K=nargs["SPLIT_K"],
                                                     BLOCK=512, CAP=nargs.get("CAP", 0.0), **pdl_flags(y))


# The pipelined row sums are off by default: on an H100 they left the e4b's step at batch 1 where it was
# (bf16 4.26 against 4.28 ms, fp8 weights + lm_head 3.25 against 3.25) and its graph replay a little slower
# (4.09 against 4.04, 3.05 against 2.96): the autotuner took them where a GEMM alone ran faster.
_offered = {"whole_k": True, "narrow": True, "row_split": True, "pipelined": False}


def row_splits(N: int, K: int) -> bool:
    """Whether split-K tiles are offered at one row to an N x K weight (while use_tiles offers them)."""
    return _offered["row_split"] and N <= NARROW_N and K >= ROW_SPLIT_MIN_K


def use_tiles(whole_k: bool = True, narrow: bool = True, row_split: bool = True, pipelined: bool = False) -> None:
    """Offer the whole-K tiles at one row, the narrow tiles at 2-32 rows, the split-K tiles at one
    row and the pipelined row sums, or not (benchmarks: their share). Forgets the tuned tiles, which
    were picked with or without them."""
    want = {"whole_k": whole_k, "narrow": narrow, "row_split": row_split, "pipelined": pipelined}
    if want != _offered:
        _offered.update(want)
        for tuner in TUNERS:
            tuner.cache.clear()


_CONFIGS, _keep = tile_configs(_ROW_SUM, _DOT, _WHOLE, _DOT_NARROW, _ROW_SPLIT, _ROW_PIPE)
_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M"], do_bench=bench_short, post_hook=_sum_splits,
                         prune_configs_by={"early_config_prune": _keep})(_skinny_kernel)
TUNERS = [_tuned]       # the autotuners ``use_tiles`` offers tiles to (the fp8 and residual-tail GEMMs' join)


def launch_tiles(tuned, kernel, args: tuple, flags: dict, config: dict | None, N: int, swap_ok: bool,
                 what: str) -> int:
    """Launch ``kernel`` on one tile ``config`` (tests, sweeps), else its autotuned ``tuned``, over
    N in BLOCK_N blocks and K in SPLIT_K splits; returns the splits taken (their sum is the caller's)."""
    if config is None:
        tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](*args, **flags)
        return tuned.best_config.kwargs["SPLIT_K"]
    meta = {**dict(SPLIT_K=1, SWAP=False, num_warps=4, num_stages=3), **config}
    if meta["SPLIT_K"] > max_split(N) or (meta["SWAP"] and not swap_ok):
        raise ValueError(f"gemma4opt {what}: config {config} (at most {max_split(N)} splits; SWAP needs 2+ rows)")
    kernel[(triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](*args, **meta, **flags)
    return meta["SPLIT_K"]


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None,
                         cap: float | None = None, up: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] with at most MAX_ROWS rows in all, weight [N, K] (unit stride along K) -> [..., N];
    with ``cap``, the logit softcap tanh(y / cap) * cap applied as the GEMM's epilogue (lm_head);
    with ``up`` (x's shape), the GEMM of gelu_tanh(x) * up, made tile by tile as it is read.

    ``config`` runs one tile instead of the autotuned one (benchmark sweeps, tests): BLOCK_N,
    BLOCK_K, and optionally SPLIT_K, SWAP, num_warps, num_stages."""
    x2 = rows_view(x)
    M, K = x2.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemma4opt skinny_linear: {M} rows, at most {MAX_ROWS} (use F.linear)")
    if weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"gemma4opt skinny_linear: weight {tuple(weight.shape)} (stride {weight.stride()}) "
                         f"does not match x [..., {K}] with unit stride along K")
    if up is not None and up.shape != x.shape:
        raise ValueError(f"gemma4opt skinny_linear: up {tuple(up.shape)} is not x's shape {tuple(x.shape)}")
    u2 = x2 if up is None else rows_view(up)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        bm = 1 if M == 1 else 16 if M <= 16 else 32
        # Room for the most splits any config may take; a config with fewer uses the first ones.
        splits = bm > 1 or row_splits(N, K) or (config or {}).get("SPLIT_K", 1) > 1
        part = torch.empty(max_split(N) * M * N if splits else 1, dtype=torch.float32, device=x.device)
        args = (x2, u2, weight, y, part, M, N, K, x2.stride(0), u2.stride(0), weight.stride(0), y.stride(0))
        flags = dict(BLOCK_M=bm, COMPILED=_COMPILED, IEEE=x.dtype == torch.float32, CAP=float(cap or 0.0),
                     GELU=up is not None, **pdl_flags(y))
        if config is None and not _COMPILED:
            bn, split = (4, 1) if bm == 1 else (16, _INTERPRETER_SPLIT)
            config = dict(BLOCK_N=bn, BLOCK_K=32, SPLIT_K=split)
        split = launch_tiles(_tuned, _skinny_kernel, args, flags, config, N, bm > 1, "skinny_linear")
        _sum_splits(dict(P=part, Y=y, M=M, N=N, SPLIT_K=split, CAP=flags["CAP"]))
    return y.view(*x.shape[:-1], N)
