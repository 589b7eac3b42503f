"""Block-scaled FP8 (e4m3) references: transformers' FineGrainedFP8 scheme (DeepSeek-V3's), the
oracle of gemma4opt::fp8_block_linear. Not an op.

    weights:     one fp32 scale per (block_n x block_k) tile of W [N, K]: ``weight_scale_inv``
                 [ceil(N / block_n), ceil(K / block_k)], stored by the checkpoint (its tiles at the
                 edges partial)
    activations: one fp32 scale per token and block_k-long group of K, computed when quantized
                 (dynamic): scale = max(amax / 448, SCALE_MIN), q = clamp(x.float() / scale, +-448)
    y[m, n]      = sum over groups g of (x_q[m, g] . W_q[n, g]) * x_scale[m, g] * w_scale[n // block_n, g]
                   in fp32, cast to x's dtype

As ops/fp8.py, every division is IEEE round-to-nearest and an all-zero group quantizes to zeros
(SCALE_MIN; transformers' kernel divides by its zero amax there).
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8 import FP8_DTYPE, FP8_MAX, SCALE_MIN


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 x [..., K] zero-padded to whole groups: [..., G, group] (zeros change no group's amax)."""
    K = x.shape[-1]
    xf = torch.nn.functional.pad(x.float(), (0, -K % group))
    return xf.reshape(*x.shape[:-1], -1, group)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    # a tensor divisor: IEEE division on every device (ops/fp8.py's quantize_rows_reference says why)
    return torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=SCALE_MIN)


def quantize_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], fp32 scales [..., ceil(K / group)]): per token, per group of K."""
    K = x.shape[-1]
    g = _grouped(x, group)
    scale = _scale(g.abs().amax(-1))
    q = torch.clamp(g / scale.unsqueeze(-1), -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(*x.shape[:-1], -1)[..., :K].contiguous(), scale.contiguous()


def quantize_blocks_reference(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K], fp32 scales [ceil(N / block_n), ceil(K / block_k)]): one scale per
    tile (the tiles at the edges partial, as a checkpoint's are)."""
    if w.dim() != 2:
        raise ValueError(f"gemma4opt fp8: a weight is [N, K], got {tuple(w.shape)}")
    N, K = w.shape
    wf = torch.nn.functional.pad(w.float(), (0, -K % block_k, 0, -N % block_n))
    tiles = wf.reshape(wf.shape[0] // block_n, block_n, wf.shape[1] // block_k, block_k)
    scale = _scale(tiles.abs().amax(dim=(1, 3)))
    q = torch.clamp(tiles / scale[:, None, :, None], -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(wf.shape)[:N, :K].contiguous(), scale.contiguous()


def dequantize_blocks_reference(q: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """fp32 q * its tile's scale (q [..., R, C], scale [..., ceil(R / block_n), ceil(C / block_k)])."""
    R, C = q.shape[-2:]
    full = scale.float().repeat_interleave(block_n, -2)[..., :R, :].repeat_interleave(block_k, -1)[..., :C]
    return q.float() * full


def dequantized_groups_reference(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 x [..., K] as the GEMM multiplies it: quantized per token and group, times its scale."""
    xq, xs = quantize_groups_reference(x, group)
    return xq.float() * xs.repeat_interleave(group, -1)[..., :x.shape[-1]]


def fp8_block_linear_reference(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                               block_n: int, block_k: int) -> torch.Tensor:
    """x [..., K] in its dtype, W [N, K] e4m3 with its tile scales -> [..., N] in x's dtype: x
    quantized per token and block_k group, both sides dequantized, multiplied in fp32."""
    xd = dequantized_groups_reference(x, block_k)
    wd = dequantize_blocks_reference(w_fp8, w_scale_inv, block_n, block_k)
    return torch.matmul(xd, wd.t()).to(x.dtype).contiguous()


def moe_experts_fp8_block_reference(x, top_k_index, top_k_weights, gate_up, gate_up_scale_inv, down,
                                    down_scale_inv, block_n: int, block_k: int, linear=fp8_block_linear_reference):
    """transformers' FP8Experts (a FineGrainedFP8 MoE checkpoint, gelu-tanh gate) in plain torch (a
    stack left in x's dtype by the checkpoint multiplies as it is, its scales unread): each
    expert that has tokens, in ascending order, runs its tokens through the block-scaled gate_up
    [E, 2I, H] and down [E, H, I] (``linear``: this file's reference, or a kernel with its semantics),
    gelu_tanh(gate) * up in x's dtype between them; the outputs times the routing weight (in x's
    dtype) are added per token in fp32, expert after expert, then rounded to x's dtype."""
    I = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

    def side(inp, w, s):      # a stack transformers left unquantized (not whole blocks): F.linear, as FP8Experts
        return linear(inp, w, s, block_n, block_k) if w.dtype == FP8_DTYPE else torch.nn.functional.linear(inp, w)

    for e in torch.unique(top_k_index).tolist():
        t, j = torch.nonzero(top_k_index == e, as_tuple=True)
        gu = side(x[t], gate_up[e], gate_up_scale_inv[e] if gate_up.dtype == FP8_DTYPE else None)
        act = torch.nn.functional.gelu(gu[:, :I], approximate="tanh") * gu[:, I:]
        y = side(act, down[e], down_scale_inv[e] if down.dtype == FP8_DTYPE else None)
        out.index_add_(0, t, (y * top_k_weights[t, j, None].to(y.dtype)).float())
    return out.to(x.dtype)
