"""gemma4opt::moe_experts_fp8_block — transformers' FP8Experts (a FineGrainedFP8 MoE checkpoint) with
gemma4opt's block-scaled GEMM.

    out = moe_experts_fp8_block(x, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down,
                                down_scale_inv, block_n, block_k)     # ops/fp8_block.py's semantics

gate_up [E, 2I, H] and down [E, H, I] in e4m3 with their tile scales, as the checkpoint stores them;
each GEMM's input quantized per token and block_k group inside it. The CPU path is the reference (its
loop over the experts with tokens). On CUDA, up to ``MAX_PAIRS`` (token, expert) pairs (decode)
take three kernels and a sum, no host sync, so decode graphs capture them: kernels/fp8_block_linear.py's
pairs GEMM for gate_up (one pair a program, its expert's weight), gemma4opt's gelu_tanh_mul, the pairs
GEMM for down, and the weighted outputs added per token over its k experts in fp32 (in slot order,
where the reference adds in expert order: fp32 rounding apart). More pairs (prefill) run the
reference's loop with the Triton GEMM for each expert's tokens (a host sync and ~8 launches per expert
with tokens).
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8_block import moe_experts_fp8_block_reference
from gemma4opt.ops.moe_experts_fp8 import sum_in_order

MAX_PAIRS = 1024


@torch.library.custom_op("gemma4opt::moe_experts_fp8_block", mutates_args=())
def moe_experts_fp8_block(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up: torch.Tensor, gate_up_scale_inv: torch.Tensor, down: torch.Tensor,
                          down_scale_inv: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    return moe_experts_fp8_block_reference(x, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down,
                                           down_scale_inv, block_n, block_k)


@moe_experts_fp8_block.register_fake
def _(x, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down, down_scale_inv, block_n, block_k):
    return torch.empty_like(x)


def moe_pairs(x, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down, down_scale_inv, block_n, block_k):
    """The decode path above (any device the Triton kernels run on, the interpreter included)."""
    from gemma4opt.kernels.fp8_block_linear import fp8_block_pairs_triton

    T, k = top_k_index.shape
    I = gate_up.shape[1] // 2
    idx = top_k_index.reshape(-1)
    gu = fp8_block_pairs_triton(x, idx, k, gate_up, gate_up_scale_inv, block_n, block_k)
    act = torch.ops.gemma4opt.gelu_tanh_mul(gu[:, :I], gu[:, I:])
    y = fp8_block_pairs_triton(act.contiguous(), idx, 1, down, down_scale_inv, block_n, block_k)
    weighted = (y.view(T, k, -1) * top_k_weights.to(y.dtype)[..., None]).float()
    return sum_in_order(weighted).to(x.dtype)


@moe_experts_fp8_block.register_kernel("cuda")
def _(x, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down, down_scale_inv, block_n, block_k):
    from gemma4opt.kernels.fp8_block_linear import fp8_block_linear_triton

    if top_k_index.numel() <= MAX_PAIRS:
        return moe_pairs(x, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down, down_scale_inv,
                         block_n, block_k)
    return moe_experts_fp8_block_reference(x, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down,
                                           down_scale_inv, block_n, block_k, linear=fp8_block_linear_triton)
