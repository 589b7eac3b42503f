"""Triton MoE router: its input (rms_norm without weight, times scale, times hidden_size ** -0.5)
in one kernel, and its tail: softmax over experts (fp32) -> top-k -> renormalize -> per-expert scale.

One program per token each; top-k by k rounds of argmax over the E probabilities (E <= 1024).
Ties pick the lowest expert index, as torch.topk does on CPU and CUDA for distinct values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import dense, pdl_flags, pdl_prologue, row_launch, rows_view
from gemma4opt.kernels.rms_norm import inv_rms


@triton.jit
def _router_input_kernel(X, SC, H, W2, N2, sx, sh, sn, D, eps, root, eps2, HAS_NORM: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    """h = round(round(round(x * rsqrt(mean(x^2) + eps)) * scale) * root): the three eager ops'
    roundings (ops/moe_router.py's _router_input) in one pass over the row. HAS_NORM: also the
    experts' input norm of the same row, n2 = round(x * rsqrt(mean(x^2) + eps2) * w2)."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dt = H.dtype.element_ty
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w2 = tl.load(W2 + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(H + row * sh + cols, router_input_row(x, SC, cols, mask, D, eps, root, dt), mask=mask)
    if HAS_NORM:
        tl.store(N2 + row * sn + cols, (x * inv_rms(x, D, eps2) * w2).to(dt), mask=mask)


@triton.jit
def router_input_row(x, SC, cols, mask, D, eps, root, dt: tl.constexpr):
    """The router's GEMM input of one fp32 row x, in dt: round(round(round(x * inv_rms) * scale) * root)."""
    sc = tl.load(SC + cols, mask=mask, other=0.0).to(tl.float32)
    n = (x * inv_rms(x, D, eps)).to(dt).to(tl.float32)
    h = (n * sc).to(dt).to(tl.float32)
    return (h * root).to(dt)


def router_input_triton(x: torch.Tensor, scale: torch.Tensor, eps: float, root: float,
                        norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0):
    """x [T, D] and scale [D] of one dtype -> the router's GEMM input [T, D] in that dtype; with
    ``norm_weight``, (that input, rms_norm(x, norm_weight, norm_eps)) from the same pass."""
    D = x.shape[-1]
    x2, (scale, norm_weight) = rows_view(x), dense(scale, norm_weight)
    h = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n2 = torch.empty_like(h) if norm_weight is not None else h
    if h.shape[0]:
        block, warps = row_launch(D, h.shape[0])
        _router_input_kernel[(h.shape[0],)](
            x2, scale, h, norm_weight if norm_weight is not None else scale, n2, x2.stride(0), h.stride(0),
            n2.stride(0), D, eps, root, norm_eps, HAS_NORM=norm_weight is not None, BLOCK=block, num_warps=warps,
            **pdl_flags(h))
    return h.view(x.shape) if norm_weight is None else (h.view(x.shape), n2.view(x.shape))


@triton.jit
def softmax_topk_store(logits, cols, mask, PES, P, TW, TI, row, E, K: tl.constexpr, BLOCK: tl.constexpr):
    """One token's tail from its logits (fp32, -inf where masked): softmax -> P, the top-K
    renormalized and scaled by their per-expert scale -> TW, their indices -> TI."""
    m = tl.max(logits, axis=0)
    e = tl.where(mask, tl.exp(logits - m), 0.0)
    p = e / tl.sum(e, axis=0)
    tl.store(P + row * E + cols, p, mask=mask)
    work = tl.where(mask, p, -1.0)
    ks = tl.arange(0, K)
    top_w = tl.zeros([K], dtype=tl.float32)
    top_i = tl.zeros([K], dtype=tl.int32)
    # Kept in registers: re-reading our own global stores within a program is not coherent on GPU.
    for k in tl.static_range(K):
        best = tl.max(work, axis=0)
        idx = tl.min(tl.where(work == best, cols, BLOCK), axis=0)
        top_w = tl.where(ks == k, best, top_w)
        top_i = tl.where(ks == k, idx, top_i)
        work = tl.where(cols == idx, -1.0, work)
    total = tl.sum(top_w, axis=0)
    tl.store(TI + row * K + ks, top_i.to(tl.int64))
    tl.store(TW + row * K + ks, (top_w / total) * tl.load(PES + top_i).to(tl.float32))


@triton.jit
def _router_kernel(L, PES, P, TW, TI, sl, E, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < E
    logits = tl.load(L + row * sl + cols, mask=mask, other=-float("inf")).to(tl.float32)
    softmax_topk_store(logits, cols, mask, PES, P, TW, TI, row, E, K, BLOCK)


def router_topk_triton(expert_logits: torch.Tensor, per_expert_scale: torch.Tensor, k: int):
    """(probs fp32 [T, E], top-k weights fp32 [T, k], top-k indices int64 [T, k])."""
    T, E = expert_logits.shape
    per_expert_scale = dense(per_expert_scale)
    probs = torch.empty((T, E), dtype=torch.float32, device=expert_logits.device)
    tw = torch.empty((T, k), dtype=torch.float32, device=expert_logits.device)
    ti = torch.empty((T, k), dtype=torch.int64, device=expert_logits.device)
    if T:
        logits = expert_logits if expert_logits.stride(-1) == 1 else expert_logits.contiguous()
        _router_kernel[(T,)](logits, per_expert_scale, probs, tw, ti, logits.stride(0), E, K=k,
                             BLOCK=triton.next_power_of_2(E), **pdl_flags(probs))
    return probs, tw, ti
