"""Triton split-KV decode attention over the paged KV pool: one query per sequence, no host plan.

Why not FlashInfer's decode here: its kernels need a host-side ``plan()`` every step (the split
schedule depends on the page counts), which costs hundreds of µs of host time per step, and at
small batches its tensor-core decode takes ~13 µs per layer for a few hundred tokens (measured
on an H200, benchmarks/bench_attention.py), far above what the KV bytes need. This kernel derives
everything from the page lists on the device, so a decode graph replays it with no plan at all.

Grid (rows, kv_heads, splits): a program takes the GROUP query heads that share one KV head and
one contiguous chunk of the visible tokens (chunks are multiples of BLOCK_N; chunks past the end
exit at once), so a batch of one still fills the GPU. Each program keeps an online softmax over
its tiles; with more than one split a second kernel merges the partial outputs by their LSE.
The split count depends on shapes only (rows, kv heads, SMs), never on lengths: a graph captured
for a bucket stays valid for every length distribution.

Tokens are indexed relative to the first live page (sliding kinds drop whole pages that left the
window, so relative distances equal absolute ones): the query is token kv_len - 1 and sees
tokens >= kv_len - window (HF's bound: the window counts the query itself).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_SPLITS = 64
# Triton's interpreter (CPU tests) cannot take loaded values as range() bounds and multiplies
# bf16 tiles as raw integers: there the loop is a while loop and tiles are multiplied in fp32.
# The compiled kernel keeps the for loop (Triton software-pipelines it, not a while loop).
_COMPILED = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _tile(q, KV, INDICES, p0, t0, end, kh, s_page, s_kv, s_tok, s_head, scale, m_i, l_i, acc, d,
          PS: tl.constexpr, BLOCK_N: tl.constexpr, COMPILED: tl.constexpr):
    """One BLOCK_N-token tile of the online softmax (tokens gathered through the page list)."""
    t = t0 + tl.arange(0, BLOCK_N)
    tmask = t < end
    page = tl.load(INDICES + p0 + t // PS, mask=tmask, other=0)
    base = page.to(tl.int64) * s_page + (t % PS) * s_tok + kh * s_head
    k = tl.load(KV + base[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    v = tl.load(KV + s_kv + base[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    if not COMPILED:
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(Q, KV, INDPTR, INDICES, LAST, O, OP, LSE,
                         sq_b, sq_h, s_page, s_kv, s_tok, s_head, so_b, so_h, sp_b, sp_h, sp_s, sl_b, sl_h,
                         window, scale,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                         BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, COMPILED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    p0 = tl.load(INDPTR + b)
    p1 = tl.load(INDPTR + b + 1)
    kv_len = (p1 - p0 - 1) * PS + tl.load(LAST + b)
    lo = 0
    if window > 0:
        lo = tl.maximum(kv_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(kv_len - lo, NSPLIT), BLOCK_N) * BLOCK_N
    start = lo + sp * chunk
    end = tl.minimum(start + chunk, kv_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    gmask = g < GROUP
    heads = kh * GROUP + g
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if COMPILED:
        for t0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _tile(q, KV, INDICES, p0, t0, end, kh, s_page, s_kv, s_tok, s_head, scale, m_i, l_i, acc,
                                  d, PS, BLOCK_N, COMPILED)
    else:
        t0 = start
        while t0 < end:
            m_i, l_i, acc = _tile(q, KV, INDICES, p0, t0, end, kh, s_page, s_kv, s_tok, s_head, scale, m_i, l_i, acc,
                                  d, PS, BLOCK_N, COMPILED)
            t0 += BLOCK_N
    empty = l_i == 0.0              # a split past the end (or a chunk with nothing visible)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if NSPLIT == 1:
        tl.store(O + b * so_b + heads[:, None] * so_h + d[None, :], out.to(O.dtype.element_ty), mask=gmask[:, None])
    else:
        tl.store(OP + b * sp_b + heads[:, None] * sp_h + sp * sp_s + d[None, :], out, mask=gmask[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(LSE + b * sl_b + heads * sl_h + sp, lse, mask=gmask)


@triton.jit
def _merge_kernel(OP, LSE, O, sp_b, sp_h, sp_s, sl_b, sl_h, so_b, so_h,
                  D: tl.constexpr, NSPLIT: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    lse = tl.load(LSE + b * sl_b + h * sl_h + s, mask=s < NSPLIT, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)                 # splits past the end: lse -inf, weight 0
    w = w / tl.sum(w, 0)
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for i in range(NSPLIT):
        wi = tl.sum(tl.where(s == i, w, 0.0), 0)
        if wi > 0:
            acc += wi * tl.load(OP + b * sp_b + h * sp_h + i * sp_s + d)
    tl.store(O + b * so_b + h * so_h + d, acc.to(O.dtype.element_ty))


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


def paged_decode_triton(q: torch.Tensor, kv: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                        kv_last_page_len: torch.Tensor, window: int, scale: float, num_sms: int,
                        splits: int | None = None) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D]; kv [pages, 2, page_size, kv_heads, D]; int32 page lists (FlashInfer's)."""
    B, H, D = q.shape
    _, _, ps, kvh, dk = kv.shape
    why = supported(H, kvh, D)
    if why is not None or dk != D:
        raise ValueError(f"gemma4opt paged decode: {why or f'q head_dim {D} != KV head_dim {dk}'}")
    group = H // kvh
    out = torch.empty_like(q)
    if B == 0:
        return out
    n = splits if splits is not None else decode_splits(B, kvh, num_sms)
    block_n = 16 if D >= 512 else 32
    if n > 1:
        part = torch.empty(B, H, n, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, n, dtype=torch.float32, device=q.device)
    else:
        part = lse = out                # unused by the kernel
    _decode_split_kernel[(B, kvh, n)](
        q, kv, kv_indptr, kv_indices, kv_last_page_len, out, part, lse,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        out.stride(0), out.stride(1), part.stride(0) if n > 1 else 0, part.stride(1) if n > 1 else 0,
        part.stride(2) if n > 1 else 0, lse.stride(0) if n > 1 else 0, lse.stride(1) if n > 1 else 0,
        window, scale,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=D, PS=ps, BLOCK_N=block_n, NSPLIT=n, COMPILED=_COMPILED,
        num_warps=8 if D >= 512 else 4, num_stages=2)
    if n > 1:
        _merge_kernel[(B, H)](part, lse, out, part.stride(0), part.stride(1), part.stride(2),
                              lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
                              D=D, NSPLIT=n, S_PAD=triton.next_power_of_2(n), num_warps=4 if D >= 512 else 2)
    return out
