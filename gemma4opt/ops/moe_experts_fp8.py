"""gemma4opt::moe_experts_fp8 — a Gemma-4 MoE experts block with e4m3 expert weights.

    gate_up [E, 2I, H], down [E, H, I]: float8_e4m3fn, one fp32 scale per (expert, output row)
    (ops/fp8.py's per-channel weight scales; gate_up_scale [E, 2I], down_scale [E, H]).
    Per (token t, chosen expert e, routing weight w), HF's experts math on the dequantized rows:
        g, u = round(x_t . (gate_up[e] * s)) split in halves      # fp32 sums, rounded to x's dtype
        a    = round(gelu_tanh(g)) * u, rounded
        y_t += round(a . (down[e] * s)) * w                       # fp32, over the k experts in order
    out = round(y)

Activations stay in the model dtype (weight-only fp8): at decode the experts' GEMVs are bound by
the weight bytes, which fp8 halves; quantizing the activations too would add error and save no time.
On CUDA up to kernels/moe_grouped.py's MAX_GROUPED_PAIRS (token, expert) pairs (decode, short
prefills) run gemma4opt's decode kernels (kernels/moe_experts.py's ``moe_experts_triton``) with the
scales in their epilogues; more (prefill) run ``moe_experts_fp8_grouped``: batched matmuls over the
experts that have tokens, padded to the busiest one's count. Their operands are the model dtype's:
e4m3 weights widen to bf16 / fp16 exactly and each product of two such values is exact in fp32, so a
tensor-core GEMM with fp32 sums (``torch.bmm(..., out_dtype=float32)``) and the scale on each row's sum
is the reference's fp32 math up to the order of the additions. (The reference's loop over experts, one
host sync and a dozen launches each, made the 26b-a4b's prefill of 128 tokens take 1044 ms against 82
in bf16 on an H200; fp32 batched matmuls over dequantized fp32 weights made its first token after a
2048-token prompt take 498 ms, 141 with this path, against 122.5 in bf16.) CPU runs the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("gemma4opt::moe_experts_fp8", mutates_args=())
def moe_experts_fp8(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
    return moe_experts_fp8_reference(x, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale)


@moe_experts_fp8.register_fake
def _(x, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale):
    return torch.empty_like(x)


def moe_experts_fp8_reference(x, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale):
    """The semantics above in plain torch: each expert that has tokens dequantized once and run on
    all of them; the weighted outputs summed over each token's k experts in fp32, in order."""
    T, k = top_k_index.shape
    I = gate_up.shape[1] // 2
    dt = x.dtype
    parts = torch.zeros(T, k, x.shape[-1], dtype=torch.float32, device=x.device)
    for e in torch.unique(top_k_index).tolist():
        t, j = torch.nonzero(top_k_index == e, as_tuple=True)
        w_gu = gate_up[e].float() * gate_up_scale[e].float()[:, None]
        gu = F.linear(x[t].float(), w_gu).to(dt)
        act = F.gelu(gu[:, :I], approximate="tanh") * gu[:, I:]
        w_d = down[e].float() * down_scale[e].float()[:, None]
        y = F.linear(act.float(), w_d).to(dt).float() * top_k_weights[t, j].float()[:, None]
        parts[t, j] = y
    return sum_in_order(parts).to(dt)


def sum_in_order(parts):
    """[T, k, H] fp32 -> [T, H]: each token's k weighted outputs added in slot order, as the kernel adds them."""
    out = parts[:, 0]
    for j in range(1, parts.shape[1]):
        out = out + parts[:, j]
    return out


# Experts widened at once: copies of this many experts' weights in the model dtype at most (the
# 26b-a4b's: 32 x 12 MB), so a prefill touching all 128 of them does not hold 1.5 GB more.
_GROUP = 32


def _exact_operand_dtype(dt: torch.dtype) -> torch.dtype:
    """The dtype the grouped path multiplies in: the model's where every e4m3 value is one of its values
    and every product of two of them is exact in fp32 (bf16: 8 x 4 significand bits; fp16: 11 x 4)."""
    return dt if dt in (torch.bfloat16, torch.float16) else torch.float32


def _bmm_fp32_sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched) with the fp32 sums returned unrounded: on CUDA a bf16 / fp16 tensor-core GEMM
    with an fp32 output, elsewhere an fp32 bmm of the same (exactly widened) values."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _widen(table: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table[experts] in dtype (exact); on CUDA in one pass (kernels/widen_e4m3.py)."""
    if table.is_cuda and table.is_contiguous():
        from gemma4opt.kernels.widen_e4m3 import widen_e4m3_triton
        return widen_e4m3_triton(table, experts, dtype)
    return table[experts].to(dtype)


def moe_experts_fp8_grouped(x, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale):
    """moe_experts_fp8_reference's math with one host sync: the (token, expert) pairs sorted by
    expert, each expert's tokens a row block of a zero-padded batch, ``_GROUP`` experts' weights
    widened and multiplied at a time (fp32 sums, the scales on each row's sum: the reference's math,
    the additions in another order)."""
    T, k = top_k_index.shape
    H = x.shape[-1]
    I = gate_up.shape[1] // 2
    dt = x.dtype
    wdt = _exact_operand_dtype(dt)
    flat = top_k_index.reshape(-1)                  # pair p = token * k + slot
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(experts.numel(), device=x.device), counts)
    rows = int(counts.max()) if counts.numel() else 0      # the one host sync
    # Row of the padded batch of each pair, by sorted position and by pair: gathers and a row
    # scatter over [pairs, H] (2-D advanced indexing took ~1.5 ms of 7.5 at 4096 tokens).
    sorted_row = group * rows + torch.arange(order.numel(), device=x.device) - starts[group]
    pair_row = torch.empty_like(sorted_row)
    pair_row[order] = sorted_row
    xs = torch.zeros(experts.numel() * rows, H, dtype=wdt, device=x.device)
    xs[sorted_row] = x[order // k].to(wdt)
    xs = xs.view(experts.numel(), rows, H)
    ys = torch.empty(experts.numel(), rows, H, dtype=dt, device=x.device)
    for g0 in range(0, experts.numel(), _GROUP):
        e = experts[g0:g0 + _GROUP]
        gu = _bmm_fp32_sums(xs[g0:g0 + _GROUP], _widen(gate_up, e, wdt).transpose(1, 2))
        gu = (gu * gate_up_scale[e].float()[:, None, :]).to(dt)
        act = (F.gelu(gu[..., :I], approximate="tanh") * gu[..., I:]).to(wdt)
        y = _bmm_fp32_sums(act, _widen(down, e, wdt).transpose(1, 2))
        ys[g0:g0 + _GROUP] = (y * down_scale[e].float()[:, None, :]).to(dt)
    parts = ys.view(-1, H)[pair_row].float() * top_k_weights.reshape(-1, 1).float()
    return sum_in_order(parts.view(T, k, H)).to(dt)


@moe_experts_fp8.register_kernel("cuda")
def _(x, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale):
    from gemma4opt.kernels.moe_experts import moe_experts_triton
    from gemma4opt.kernels.moe_grouped import MAX_GROUPED_PAIRS

    if (x.dim() == 2 and 0 < top_k_index.numel() <= MAX_GROUPED_PAIRS and gate_up.stride(-1) == 1
            and down.stride(-1) == 1):
        return moe_experts_triton(x, top_k_index, top_k_weights, gate_up, down,
                                  gate_up_scale=gate_up_scale, down_scale=down_scale)
    if x.dim() == 2 and top_k_index.numel():
        return moe_experts_fp8_grouped(x, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale)
    return moe_experts_fp8_reference(x, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale)
