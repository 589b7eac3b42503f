"""gemma4opt::moe_experts — one Gemma-4 MoE experts block: ``experts(x, top_k_index, top_k_weights)``.

Everywhere but CUDA decode it runs the model's own experts module (HF's experts implementation,
grouped GEMMs by default), so prefill and CPU results are exactly HF's. On CUDA with at most
kernels/moe_grouped.py's ``MAX_GROUPED_PAIRS`` (token, expert) pairs, each shape runs whichever of
gemma4opt's decode kernels (pair by pair up to 64 pairs, kernels/moe_experts.py, expert by expert
above) and HF's path timed faster on its first call, outside graph capture, and only if its output
matched HF's there (ops/pick.py; the same rule as ``gemma4opt.linear``). Above 8 tokens a pick
holds for the token counts up to the next power of two: prefills of a few dozen tokens of every
length would otherwise each be timed.

The module is found through ``module_key`` in the calling model's OpState (ops/state.py; weak
references): a custom op takes tensors and numbers, not modules, and the weights are passed as
tensors too so the graph shows what the op reads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gemma4opt.ops.pick import bench_cold, check_close
from gemma4opt.ops.state import OpState, current, picks_api, picks_for


# Picks: (tokens, k, experts, 2I, H, dtype, device index) -> the Triton path, per optimized model.
picks, failures = picks_api("moe_experts")


def register_experts(module: torch.nn.Module, state: OpState | None = None) -> int:
    """The key ``gemma4opt.moe_experts`` finds this experts module by in ``state`` (default: the
    active one, the model's own while its forward compiles), kept weakly."""
    (state if state is not None else current()).experts[id(module)] = module
    return id(module)


def _module(key: int) -> torch.nn.Module:
    m = current().experts.get(key)
    if m is None:
        raise RuntimeError("gemma4opt.moe_experts: its experts module is not in the running model's op state "
                           "(the model was freed, or the op ran outside the model's forward?)")
    return m


@torch.library.custom_op("gemma4opt::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, module_key: int) -> torch.Tensor:
    return _module(module_key)(x, top_k_index, top_k_weights)


@moe_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, module_key):
    return torch.empty_like(x)


def moe_experts_reference(x, top_k_index, top_k_weights, gate_up, down):
    """Plain torch, pair by pair (the kernels' test oracle; small shapes only): HF's roundings
    (GEMM outputs and gelu's output in the model dtype, routing weights and the sum over k in fp32)."""
    T, k = top_k_index.shape
    I = gate_up.shape[1] // 2
    out = torch.zeros(T, k, x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(T):
        for j in range(k):
            e = int(top_k_index[t, j])
            gu = F.linear(x[t:t + 1], gate_up[e])
            act = F.gelu(gu[:, :I], approximate="tanh") * gu[:, I:]
            out[t, j] = (F.linear(act, down[e]) * top_k_weights[t, j].float())[0]
    return out.sum(dim=1).to(x.dtype)


def _time_both(x, idx, w, gate_up, down, module) -> tuple[float, float]:
    from gemma4opt.kernels.moe_experts import moe_experts_triton

    check_close(moe_experts_triton(x, idx, w, gate_up, down), module(x, idx, w),
                what="gemma4opt's decode experts", other="HF's experts path")
    return (bench_cold(lambda: moe_experts_triton(x, idx, w, gate_up, down)),
            bench_cold(lambda: module(x, idx, w)))


def pick_tokens(tokens: int) -> int:
    """The token count a shape's pick is keyed by: itself up to 8, else the next power of two."""
    return tokens if tokens <= 8 else 1 << (tokens - 1).bit_length()


def runs_triton(x, top_k_index, top_k_weights, gate_up, down, module) -> bool:
    """Whether this CUDA call runs gemma4opt's decode kernels: a decode step's pairs, unit-stride
    expert rows, and a shape the active model's picks give to the kernels (timed now if new)."""
    from gemma4opt.kernels.moe_grouped import MAX_GROUPED_PAIRS

    if not (x.dim() == 2 and 0 < top_k_index.numel() <= MAX_GROUPED_PAIRS and gate_up.stride(-1) == 1
            and down.stride(-1) == 1):
        return False
    key = (pick_tokens(x.shape[0]), top_k_index.shape[-1], *gate_up.shape[:2], x.shape[1], x.dtype, x.device.index)
    return picks_for("moe_experts").pick(key, lambda: _time_both(x, top_k_index, top_k_weights, gate_up, down, module))


@moe_experts.register_kernel("cuda")
def _(x, top_k_index, top_k_weights, gate_up, down, module_key):
    module = _module(module_key)
    if runs_triton(x, top_k_index, top_k_weights, gate_up, down, module):
        from gemma4opt.kernels.moe_experts import moe_experts_triton

        return moe_experts_triton(x, top_k_index, top_k_weights, gate_up, down)
    return module(x, top_k_index, top_k_weights)
