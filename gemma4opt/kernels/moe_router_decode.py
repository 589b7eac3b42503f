"""Triton MoE router for decode rows: the router's input, its GEMM, the softmax and top-k in one launch.

At decode the router was three or four launches per MoE layer (its input kernel, cuBLAS's split-K
GEMM and its reduce, the softmax / top-k kernel: ~11.6 us per layer on an H200 for 0.7 MB of
weights, the 26b-a4b with fp8 weights profiled with PDL off). Here programs (token, block of
experts) each recompute the token's router input (a 2816-wide row, from L2), multiply it by their
experts' rows and store the rounded logits; the last program of the token to finish (an atomic
count) reads all E logits and runs the tail (kernels/moe_router.py's ``softmax_topk_store``), then
sets the count back to 0, so the count buffer is zero for the next call and no memset is launched.

Roundings are eager's: the input rounded after each of its three ops, each logit an fp32 sum
rounded to the model dtype (what F.linear returns; cuBLAS adds in another order), softmax and
top-k in fp32 from those logits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemma4opt.kernels._util import pdl_flags, pdl_prologue, zeroed_counters
from gemma4opt.kernels.moe_router import router_input_row, softmax_topk_store
from gemma4opt.kernels.rms_norm import inv_rms

MAX_ROWS = 32          # decode rows; above, the input kernel + GEMM + tail (one weight read for all rows)
MAX_EXPERTS = 1024
# (experts a program, warps) by rows, from ``bench_kernels.py --sweep router`` at the 26b-a4b's shapes on an
# H200 (sweeps_h200.jsonl): 5.7 / 6.4 / 9.0 us at 1 / 8 / 32 rows, against 10.3 / 10.4 / 11.0 for the three
# launches it replaces (kernels_h200.jsonl). More rows re-read each program's expert rows per token: wider blocks.
TILES = ((1, dict(block_e=1, warps=2)), (8, dict(block_e=4, warps=4)), (MAX_ROWS, dict(block_e=8, warps=2)))
_COUNTS: dict = {}


@triton.jit
def _router_decode_kernel(X, SC, WP, PES, W2, N2, LG, CNT, P, TW, TI, sx, sn, D, E, eps, root, eps2,
                          HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                          E_PAD: tl.constexpr, K: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    dt = LG.dtype.element_ty
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    h = router_input_row(x, SC, cols, mask, D, eps, root, dt).to(tl.float32)
    if HAS_NORM:
        if pid == 0:
            w2 = tl.load(W2 + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(N2 + row * sn + cols, (x * inv_rms(x, D, eps2) * w2).to(dt), mask=mask)
    e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    w = tl.load(WP + e.to(tl.int64)[:, None] * D + cols[None, :], mask=emask[:, None] & mask[None, :], other=0.0)
    tl.store(LG + row * E + e, tl.sum(w.to(tl.float32) * h[None, :], 1).to(dt), mask=emask)
    # Every thread's logit stores are issued before the count goes up (the barrier); the atomic's
    # release / acquire then makes them, and every other program's, visible to the last program.
    tl.debug_barrier()
    done = tl.atomic_add(CNT + row, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:
        ecols = tl.arange(0, E_PAD)
        emask_all = ecols < E
        logits = tl.load(LG + row * E + ecols, mask=emask_all, other=float("-inf"), cache_modifier=".cg")
        softmax_topk_store(logits.to(tl.float32), ecols, emask_all, PES, P, TW, TI, row, E, K, E_PAD)
        tl.store(CNT + row, 0)


def _counts(device: torch.device) -> torch.Tensor | None:
    """The device's per-row counts (each call leaves them zero)."""
    return zeroed_counters(_COUNTS, device, MAX_ROWS)


def router_decode_supported(x: torch.Tensor, scale: torch.Tensor, proj_weight: torch.Tensor, top_k: int,
                            norm_weight: torch.Tensor | None = None) -> bool:
    """Decode rows of one dtype with contiguous weights, E <= MAX_EXPERTS, a power-of-two top-k, and
    the count buffer in place (it is made on the first call outside a graph capture)."""
    T, E = x.shape[0], proj_weight.shape[0]
    weights = [scale, proj_weight] + ([norm_weight] if norm_weight is not None else [])
    return (x.dim() == 2 and 0 < T <= MAX_ROWS and E <= MAX_EXPERTS and top_k & (top_k - 1) == 0
            and all(w.dtype == x.dtype and w.is_contiguous() for w in weights) and scale.dim() == 1
            and proj_weight.shape[1] == x.shape[1] and _counts(x.device) is not None)


def router_decode_triton(x: torch.Tensor, scale: torch.Tensor, proj_weight: torch.Tensor,
                         per_expert_scale: torch.Tensor, eps: float, root: float, top_k: int,
                         norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0, launch: dict | None = None):
    """x [T, D] (T <= MAX_ROWS) -> (probs fp32 [T, E], top-k weights fp32 [T, k], indices int64 [T, k]
    [, rms_norm(x, norm_weight, norm_eps)]); see router_decode_supported for what it takes."""
    T, D = x.shape
    E = proj_weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    dev = x.device
    probs = torch.empty((T, E), dtype=torch.float32, device=dev)
    tw = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ti = torch.empty((T, top_k), dtype=torch.int64, device=dev)
    logits = torch.empty((T, E), dtype=x.dtype, device=dev)
    n2 = torch.empty_like(x) if norm_weight is not None else logits
    t = {**next(tile for rows, tile in TILES if T <= rows), **(launch or {})}
    _router_decode_kernel[(T, triton.cdiv(E, t["block_e"]))](
        x, scale, proj_weight, per_expert_scale, norm_weight if norm_weight is not None else scale, n2, logits,
        _counts(dev), probs, tw, ti, x.stride(0), n2.stride(0), D, E, eps, root, norm_eps,
        HAS_NORM=norm_weight is not None, BLOCK_D=triton.next_power_of_2(D), BLOCK_E=t["block_e"],
        E_PAD=triton.next_power_of_2(E), K=top_k, num_warps=t["warps"], **pdl_flags(x))
    return (probs, tw, ti) if norm_weight is None else (probs, tw, ti, n2)
