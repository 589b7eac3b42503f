"""gemma4opt::gelu_tanh_mul — ``gelu(gate, approximate="tanh") * up`` (MLP, experts, PLE gate)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("gemma4opt::gelu_tanh_mul", mutates_args=())
def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gelu_tanh_mul_reference(gate, up)


def gelu_tanh_mul_reference(gate, up):
    return (F.gelu(gate, approximate="tanh") * up).contiguous()


@gelu_tanh_mul.register_fake
def _(gate, up):
    return torch.empty(torch.broadcast_shapes(gate.shape, up.shape), dtype=gate.dtype, device=gate.device)


@gelu_tanh_mul.register_kernel("cuda")
def _(gate, up):
    from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton

    if gate.shape != up.shape:            # PLE: per_layer_input may broadcast; keep exact semantics
        return gelu_tanh_mul_reference(gate, up)
    return gelu_tanh_mul_triton(gate, up)
