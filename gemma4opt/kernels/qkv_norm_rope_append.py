"""Triton q/k/v prep + paged KV append for one layer, in one launch.

Unfused, a decode step spends four launches per layer here (q norm+RoPE, k norm+RoPE, v norm,
kv_append), each a few µs of mostly latency at batch 1. One grid covers both jobs: the first
programs take (token, q-head block) and write q; the rest take (real token, kv-head block),
normalize and rotate K, normalize V, and store both straight into the token's page slot (into
an fp8 pool quantized with the layer's k and v scales, after rounding to the model's dtype as the
unfused ops' outputs are: ops/kv_append.py states the semantics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import dense, pdl_flags, pdl_prologue
from gemma4opt.kernels.fp8_quant import fp8_quantize
from gemma4opt.kernels.rms_norm_rope import expand_cos_sin, head_block, norm_rope_store, norm_rope_tile


@triton.jit
def _qkv_norm_rope_append_kernel(
        Q, WQ, K, WK, V, C, Sn, QO, KV, KV_SCALE, TOKEN_INDEX, SLOTS, S, HQ, HK, NQ_PROGRAMS, QBLOCKS, KBLOCKS,
        sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, scb, scs, ssb, sss,
        s_page, s_kv, s_slot, s_head, PAGE_SIZE, D, HALF, eps, HB: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr,
        PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < HALF
    dt = QO.dtype.element_ty
    if pid < NQ_PROGRAMS:                          # q: every row of the step
        tok = (pid // QBLOCKS).to(tl.int64)
        heads = (pid % QBLOCKS) * HB + tl.arange(0, HB)
        b, s = tok // S, tok % S
        norm_rope_store(Q + b * sqb + s * sqs, sqh, WQ, C + b * scb + s * scs, Sn + b * ssb + s * sss, QO, tok, HQ,
                        heads, cols, heads < HQ, cmask, HALF, D, eps)
    else:                                          # k/v: the real tokens only, into their slots
        p = pid - NQ_PROGRAMS
        i = p // KBLOCKS
        heads = (p % KBLOCKS) * HB + tl.arange(0, HB)
        hmask = heads < HK
        mask = hmask[:, None] & cmask[None, :]
        src = tl.load(TOKEN_INDEX + i).to(tl.int64)
        b, s = src // S, src % S
        slot = tl.load(SLOTS + i).to(tl.int64)
        kvt = KV.dtype.element_ty
        dst = KV + (slot // PAGE_SIZE) * s_page + (slot % PAGE_SIZE) * s_slot \
            + heads[:, None].to(tl.int64) * s_head + cols[None, :]
        k1, k2 = norm_rope_tile(K + b * skb + s * sks, skh, WK, C + b * scb + s * scs, Sn + b * ssb + s * sss,
                                heads, cols, hmask, cmask, HALF, D, eps, dt)
        vp = V + b * svb + s * svs + heads[:, None].to(tl.int64) * svh + cols[None, :]
        v1 = tl.load(vp, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(vp + HALF, mask=mask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(v1 * v1, axis=1) + tl.sum(v2 * v2, axis=1)) / D + eps)
        v1, v2 = (v1 * inv[:, None]).to(dt), (v2 * inv[:, None]).to(dt)
        k1, k2 = k1.to(dt), k2.to(dt)
        if FP8:     # the layer's scales: [k, v] fp32
            ks, vs = tl.load(KV_SCALE), tl.load(KV_SCALE + 1)
            tl.store(dst, fp8_quantize(k1.to(tl.float32), ks), mask=mask)
            tl.store(dst + HALF, fp8_quantize(k2.to(tl.float32), ks), mask=mask)
            tl.store(dst + s_kv, fp8_quantize(v1.to(tl.float32), vs), mask=mask)
            tl.store(dst + s_kv + HALF, fp8_quantize(v2.to(tl.float32), vs), mask=mask)
        else:
            tl.store(dst, k1.to(kvt), mask=mask)
            tl.store(dst + HALF, k2.to(kvt), mask=mask)
            tl.store(dst + s_kv, v1.to(kvt), mask=mask)
            tl.store(dst + s_kv + HALF, v2.to(kvt), mask=mask)


def qkv_norm_rope_append_triton(kv, q, q_weight, k, k_weight, v, cos, sin, eps, slot_mapping, token_index,
                                launch: dict | None = None, kv_scale: torch.Tensor | None = None):
    """kv [pages, 2, page_size, kv_heads, D]; q/k/v [B, S, heads, D] (unit stride on D or copied);
    kv_scale [2] fp32 (k, v) for an fp8 pool.
    ``launch`` = dict(hb=, warps=) forces the launch (rms_norm_rope.head_block)."""
    fp8 = kv.dtype == torch.float8_e4m3fn
    B, S, HQ, D = q.shape
    HK = k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    q_weight, k_weight = dense(q_weight, k_weight)
    cos, sin = expand_cos_sin(cos, sin, B, S, D)
    out = torch.empty((B, S, HQ, D), dtype=q.dtype, device=q.device)
    n = token_index.shape[0]
    if B * S == 0:
        return out
    hb, block, warps = head_block(B * S + n, max(HQ, HK), D // 2, launch)
    qblocks, kblocks = triton.cdiv(HQ, hb), triton.cdiv(HK, hb)
    nq = B * S * qblocks
    _qkv_norm_rope_append_kernel[(nq + n * kblocks,)](
        q, q_weight, k, k_weight, v, cos, sin, out, kv, kv_scale if fp8 else kv, token_index, slot_mapping, S, HQ, HK, nq, qblocks, kblocks,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.shape[2], D, D // 2, eps,
        HB=hb, BLOCK=block, FP8=fp8, num_warps=warps, **pdl_flags(out))
    return out
