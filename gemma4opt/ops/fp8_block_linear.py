"""gemma4opt::fp8_block_linear — a block-scaled FP8 projection (transformers' FineGrainedFP8 linears).

    y = fp8_block_linear(x, w_fp8, w_scale_inv, block_n, block_k)      # ops/fp8_block.py's semantics

x [..., K] in the model's dtype (quantized inside the op, per token and block_k group), w_fp8
[N, K] e4m3 with ``weight_scale_inv`` [ceil(N / block_n), ceil(K / block_k)] in fp32 or UE8M0
(scale_fmt="ue8m0": powers of two), as a FineGrainedFP8 checkpoint stores them. The CPU path is
the reference. On CUDA: kernels/fp8_block_linear.py's Triton GEMM for every row count (the
activations' quantization inside it), the reference where its block_k or operands do not fit
(ops/fp8_checkpoint.py adopts only linears that fit).

Backward (adapters trained on an fp8 checkpoint, as transformers' FP8Linear allows): the input's
gradient through the dequantized weight, none for the weight and its scales.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8_block import dequantize_blocks_reference, fp8_block_linear_reference


@torch.library.custom_op("gemma4opt::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, block_n: int,
                     block_k: int) -> torch.Tensor:
    return fp8_block_linear_reference(x, w_fp8, w_scale_inv, block_n, block_k)


@fp8_block_linear.register_fake
def _(x, w_fp8, w_scale_inv, block_n, block_k):
    return torch.empty((*x.shape[:-1], w_fp8.shape[0]), dtype=x.dtype, device=x.device)


def triton_takes(w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, block_k: int) -> bool:
    from gemma4opt.kernels.fp8_block_linear import BLOCK_KS, SCALE_DTYPES

    # (an fp8 checkpoint's weights cast by .to(dtype) reach here in that dtype: the reference takes them)
    return (block_k in BLOCK_KS and w_fp8.dtype == torch.float8_e4m3fn and w_fp8.stride(-1) == 1
            and w_scale_inv.dtype in SCALE_DTYPES)


@fp8_block_linear.register_kernel("cuda")
def _(x, w_fp8, w_scale_inv, block_n, block_k):
    if triton_takes(w_fp8, w_scale_inv, block_k):
        from gemma4opt.kernels.fp8_block_linear import fp8_block_linear_triton

        return fp8_block_linear_triton(x, w_fp8, w_scale_inv, block_n, block_k)
    return fp8_block_linear_reference(x, w_fp8, w_scale_inv, block_n, block_k)


def _setup(ctx, inputs, output):
    _, w_fp8, w_scale_inv, block_n, block_k = inputs
    ctx.save_for_backward(w_fp8, w_scale_inv)
    ctx.blocks = (block_n, block_k)


def _backward(ctx, grad):
    w_fp8, w_scale_inv = ctx.saved_tensors
    w = dequantize_blocks_reference(w_fp8, w_scale_inv, *ctx.blocks).to(grad.dtype)
    return grad @ w, None, None, None, None


fp8_block_linear.register_autograd(_backward, setup_context=_setup)
