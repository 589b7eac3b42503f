"""Triton split-KV decode attention over the paged KV pool: one query per sequence, no host plan.

Why not FlashInfer's decode here: its kernels need a host-side ``plan()`` every step (the split
schedule depends on the page counts), which costs hundreds of µs of host time per step, and at
small batches its tensor-core decode takes ~13 µs per layer for a few hundred tokens (measured
on an H200, benchmarks/bench_attention.py), far above what the KV bytes need. This kernel derives
everything from the device page table and the lengths, so a decode graph replays it with no plan.

Grid (rows, kv_heads, splits): a program takes the GROUP query heads that share one KV head and
one contiguous chunk of the visible tokens (chunks are multiples of BLOCK_N; chunks past the end
exit at once), so a batch of one still fills the GPU. Each program keeps an online softmax over
its tiles; with more than one split a second kernel merges the partial outputs by their LSE.
The split count depends on shapes only (rows, kv heads, SMs), never on lengths: a graph captured
for a bucket stays valid for every length distribution.

Pages are read through the kind's page table (paged/tables.py keeps it on the host and
StepContext mirrors its changes to the device): token t of row b sits in page
``table[b, (t // page_size) % ring]`` at offset ``t % page_size``. Row b holds ``seq_lens[b]``
tokens; its query is the last one and sees tokens >= seq_len - window (HF's bound: the window
counts the query itself). The host frees a sliding page only once no query can see it, so every
slot the kernel reads holds a live page.

An fp8 (e4m3) pool is read with the layer's scales ``kv_scale`` [k, v] fp32: tiles are converted
to the queries' dtype (exact: every e4m3 value is a bf16, fp16 and fp32 value) and the scales
are applied once, not per element: k's folded into the softmax scale, v's on the output (the
reference, ops/kv_append.py, multiplies the values; equal up to rounding, exactly at scale 1).
bf16 queries over an fp8 pool run their dots in fp16 (``launch_config``'s f16): over fp8 pages
this kernel is bound by its instructions, not its bytes, converting the tiles among the most, and
e4m3 -> fp16 is one instruction where -> bf16 takes three.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import COMPILED as _COMPILED, pdl_flags, pdl_prologue

MAX_SPLITS = 64
# Triton's interpreter (CPU tests) cannot take loaded values as range() bounds and multiplies
# bf16 tiles as raw integers: there the loop is a while loop and tiles are multiplied in fp32.
# The compiled kernel keeps the for loop (Triton software-pipelines it, not a while loop).


@triton.jit
def _kv_rows(TABLE, row_base, ring, t, tmask, kh, s_page, s_tok, s_head, PS: tl.constexpr):
    """Where the K rows of tokens t start in the pool, through the page table (masked: page 0)."""
    page = tl.load(TABLE + row_base + (t // PS) % ring, mask=tmask, other=0)
    return page.to(tl.int64) * s_page + (t % PS) * s_tok + kh * s_head


@triton.jit
def _load_kv(KV, base, tmask, s_kv, d):
    """The K and V rows starting at ``base`` (masked: 0)."""
    k = tl.load(KV + base[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    v = tl.load(KV + s_kv + base[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    return k, v


@triton.jit
def _attend(q, k, v, tmask, scale, m_i, l_i, acc, COMPILED: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
            V_WIDE: tl.constexpr):
    """One tile of the online softmax over loaded K/V rows (tmask: the tile's real tokens, at least
    one); with an fp8 pool the tiles take q's dtype, which the caller may have made fp16 (F16 below)."""
    if FP8:         # e4m3 -> the queries' dtype, exactly; the scales are applied by the caller
        k, v = k.to(q.dtype), v.to(q.dtype)
        if V_WIDE:
            # Triton stages an fp8 tile in shared memory as fp8 and converts it after. For v, the
            # operand whose dot contracts over tokens (its strided dim), that means one ld.shared.b8
            # per element (sm_90 has no 8-bit ldmatrix.trans; seen in the PTX). An op with a
            # per-token operand after the conversion keeps the conversion ahead of the staging (a
            # splat would be folded or hoisted): v is staged in fp16 and read with ldmatrix.trans.
            # A select on the mask (a no-op: masked rows were loaded as 0). A multiply by the mask
            # takes fewer instructions (642 a 32-token tile at head_dim 256, against 745) but ran
            # slower on the H200 at head_dim 512 (312 µs against 274 at 32 rows of 4096 tokens).
            v = tl.where(tmask[:, None], v, 0.0)
    if not COMPILED:
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    if IEEE:        # fp32 models: exact products (Triton's default for fp32 dots is TF32, ~1e-3 off)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _tile(q, KV, TABLE, row_base, ring, t0, end, kh, s_page, s_kv, s_tok, s_head, scale, m_i, l_i, acc, d,
          PS: tl.constexpr, BLOCK_N: tl.constexpr, COMPILED: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
          V_WIDE: tl.constexpr):
    """One BLOCK_N-token tile of the online softmax, loaded and attended."""
    t = t0 + tl.arange(0, BLOCK_N)
    tmask = t < end
    k, v = _load_kv(KV, _kv_rows(TABLE, row_base, ring, t, tmask, kh, s_page, s_tok, s_head, PS), tmask, s_kv, d)
    return _attend(q, k, v, tmask, scale, m_i, l_i, acc, COMPILED, IEEE, FP8, V_WIDE)


@triton.jit
def _decode_split_kernel(Q, KV, KV_SCALE, TABLE, LENS, O, OP, LSE,
                         sq_b, sq_h, s_page, s_kv, s_tok, s_head, s_table, ring, so_b, so_h, sp_b, sp_h, sp_s,
                         sl_b, sl_h, window, scale,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                         BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, TOKENS: tl.constexpr, COMPILED: tl.constexpr,
                         IEEE: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr, V_WIDE: tl.constexpr,
                         PDL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    # Everything, the lengths and page table included, is read after the PDL wait. Reading them and
    # the first tile of past tokens before it (only this step's new tokens after) was measured slower
    # on an H100: docs/architecture.md.
    pdl_prologue(PDL)
    kv_len = tl.load(LENS + b)
    row_base = (b // TOKENS) * s_table      # TOKENS query rows (a sequence's new tokens) share a table row
    lo = 0
    if window > 0:
        lo = tl.maximum(kv_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(kv_len - lo, NSPLIT), BLOCK_N) * BLOCK_N
    start = lo + sp * chunk
    end = tl.minimum(start + chunk, kv_len)
    d = tl.arange(0, D)
    qk_scale = scale
    if FP8:         # k's scale multiplies every score: folded into the softmax scale
        qk_scale = scale * tl.load(KV_SCALE)

    g = tl.arange(0, G_PAD)
    gmask = g < GROUP
    heads = kh * GROUP + g
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None], other=0.0)
    if F16:         # fp8 pages into bf16 dots: e4m3 -> fp16 is one instruction, -> bf16 three
        q = q.to(tl.float16)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    t0 = start
    if COMPILED:
        for t1 in range(t0, end, BLOCK_N):
            m_i, l_i, acc = _tile(q, KV, TABLE, row_base, ring, t1, end, kh, s_page, s_kv, s_tok, s_head, qk_scale,
                                  m_i, l_i, acc, d, PS, BLOCK_N, COMPILED, IEEE, FP8, V_WIDE)
    else:
        while t0 < end:
            m_i, l_i, acc = _tile(q, KV, TABLE, row_base, ring, t0, end, kh, s_page, s_kv, s_tok, s_head, qk_scale,
                                  m_i, l_i, acc, d, PS, BLOCK_N, COMPILED, IEEE, FP8, V_WIDE)
            t0 += BLOCK_N
    empty = l_i == 0.0              # a split past the end (or a chunk with nothing visible)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if FP8:         # v's scale: on the (partial) output, which the merge combines linearly
        out = out * tl.load(KV_SCALE + 1)
    if NSPLIT == 1:
        tl.store(O + b * so_b + heads[:, None] * so_h + d[None, :], out.to(O.dtype.element_ty), mask=gmask[:, None])
    else:
        tl.store(OP + b * sp_b + heads[:, None] * sp_h + sp * sp_s + d[None, :], out, mask=gmask[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(LSE + b * sl_b + heads * sl_h + sp, lse, mask=gmask)


@triton.jit
def _merge_kernel(OP, LSE, O, sp_b, sp_h, sp_s, sl_b, sl_h, so_b, so_h,
                  NSPLIT: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    # One program per (row, head, BLOCK_D columns), every split's partial loaded at once: a loop
    # over splits would wait on one load after another (64 round trips at a batch of one).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = tl.arange(0, S_PAD)
    lse = tl.load(LSE + b * sl_b + h * sl_h + s, mask=s < NSPLIT, other=float("-inf"))
    live = lse > float("-inf")          # splits past the end hold nothing: not even read
    w = tl.where(live, tl.exp(lse - tl.max(lse, 0)), 0.0)
    part = tl.load(OP + b * sp_b + h * sp_h + s[:, None] * sp_s + d[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * so_b + h * so_h + d, out.to(O.dtype.element_ty))


def decode_splits(rows: int, kv_heads: int, num_sms: int) -> int:
    """Splits per sequence so that rows x kv_heads x splits fills the GPU about twice (shapes only)."""
    return max(1, min(MAX_SPLITS, -(-2 * num_sms // max(rows * kv_heads, 1))))


def supported(num_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """None when the kernel handles this geometry, else why not."""
    if num_heads % kv_heads:
        return f"{num_heads} query heads are not a multiple of {kv_heads} KV heads"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if num_heads // kv_heads > 64:
        return f"{num_heads // kv_heads} query heads per KV head (at most 64)"
    return None


def launch_config(head_dim: int, rows: int, fp8: bool = False) -> dict:
    """BLOCK_N, num_warps, num_stages (and maxnreg where set) of the split kernel, and for an fp8 pool
    whether its dots run in fp16. Measured on an H200 (benchmarks/bench_attention.py, 31b geometry):
    head_dim 512 takes 16-token tiles on 8 warps best at one row of short context (7.8 µs against 9.2
    at 160 tokens) and 32-token tiles on 4 warps from 8 rows up (8 rows of 4096 tokens: 90 µs against
    128; 64 rows: 511 µs, 99 % of copy bandwidth, against 928); head_dim 256: 32 on 4.

    An fp8 pool is bound by its instructions and their latency, not by its bytes: fp16 dots (e4m3 ->
    fp16 is one instruction), v staged in fp16 (the kernel's V_WIDE), and 32-token tiles on 4 warps at
    every row count. At head_dim 256 the registers are capped at 128 (142 otherwise; no spill), so that
    four programs share an SM rather than three. In one run (2026-12-03/attention-fp8-final), at 32 and
    64 rows of 4096 tokens the sliding layer took 118 / 229 µs, 55-56 % of copy bandwidth, against
    154 / 295 with 64-token tiles and v staged in fp8; the full one 275 / 478, 47-54 %, against 349 /
    681 (64 on 8 warps); one row of 4096 tokens, full: 13.8 µs against 19.7 (16 on 8 warps)."""
    if fp8:
        return dict(block_n=32, num_warps=4, num_stages=2, f16=True, **({"maxnreg": 128} if head_dim <= 256 else {}))
    if head_dim >= 512 and rows < 8:
        return dict(block_n=16, num_warps=8, num_stages=2, f16=False)
    return dict(block_n=32, num_warps=4, num_stages=2, f16=False)


def paged_decode_triton(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor,
                        window: int, scale: float, num_sms: int, splits: int | None = None,
                        config: dict | None = None, tokens: int = 1,
                        kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D]; kv [pages, 2, page_size, kv_heads, D]; table [>= B / tokens, ring]
    and seq_lens [B] int32. Row b of q is the query of table row ``b // tokens`` that sees the first
    ``seq_lens[b]`` tokens: ``tokens`` > 1 runs a step of that many new tokens per sequence (a draft
    to verify) as rows of one token each, query t of a sequence seeing its past and new tokens <= t.
    An fp8 (e4m3) pool needs ``kv_scale`` [2] fp32, the layer's k and v scales."""
    B, H, D = q.shape
    if B % tokens:
        raise ValueError(f"gemma4opt paged decode: {B} query rows are not a whole number of {tokens}-token steps")
    if seq_lens.shape[0] != B:
        raise ValueError(f"gemma4opt paged decode: {B} query rows and {seq_lens.shape[0]} lengths (a query per "
                         "staged token: a step's queries must be all its tokens)")
    _, _, ps, kvh, dk = kv.shape
    why = supported(H, kvh, D)
    if why is not None or dk != D:
        raise ValueError(f"gemma4opt paged decode: {why or f'q head_dim {D} != KV head_dim {dk}'}")
    fp8 = kv.dtype == torch.float8_e4m3fn
    if fp8 and kv_scale is None:
        raise ValueError("gemma4opt paged decode: an fp8 KV pool needs kv_scale (the layer's k and v scales)")
    group = H // kvh
    out = torch.empty_like(q)
    if B == 0:
        return out
    n = splits if splits is not None else decode_splits(B, kvh, num_sms)
    cfg = {**launch_config(D, B, fp8), **(config or {})}
    # F16: bf16 queries over an fp8 pool run their dots in fp16 (every e4m3 value and every bf16
    # query element of magnitude in [2^-14, 65504] is exact in fp16, and Gemma-4's queries are
    # RMS-normalized per head, |q| ~ sqrt(head_dim) x q_norm's weight; p in [0, 1] is rounded finer
    # than in bf16).
    f16 = bool(cfg.get("f16", False)) and fp8 and q.dtype == torch.bfloat16
    # Partial outputs and LSEs per split (one split writes ``out`` directly: placeholders then).
    shape = (B, H, n) if n > 1 else (1, 1, 1)
    part = torch.empty(*shape, D if n > 1 else 1, dtype=torch.float32, device=q.device)
    lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B, kvh, n)](
        q, kv, kv_scale if fp8 else kv, table, seq_lens, out, part, lse,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), table.stride(0),
        table.shape[1], out.stride(0), out.stride(1), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), window, scale,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=D, PS=ps, BLOCK_N=cfg["block_n"], NSPLIT=n,
        TOKENS=tokens, COMPILED=_COMPILED, IEEE=q.dtype == torch.float32, FP8=fp8, F16=f16,
        V_WIDE=bool(cfg.get("v_wide", True)), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
        **pdl_flags(out))
    if n > 1:
        block_d = min(D, 64)
        _merge_kernel[(B, H, D // block_d)](part, lse, out, part.stride(0), part.stride(1), part.stride(2),
                                            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
                                            NSPLIT=n, S_PAD=triton.next_power_of_2(n), BLOCK_D=block_d, num_warps=2,
                                            **pdl_flags(out))
    return out
