"""gemma4opt::linear_softcap — lm_head GEMM with the logit softcap applied to its output in place.

    logits = tanh(linear(x, weight) / cap) * cap
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("gemma4opt::linear_softcap", mutates_args=())
def linear_softcap(x: torch.Tensor, weight: torch.Tensor, cap: float) -> torch.Tensor:
    return linear_softcap_reference(x, weight, cap)


def linear_softcap_reference(x, weight, cap):
    return torch.tanh(F.linear(x, weight) / cap) * cap


@linear_softcap.register_fake
def _(x, weight, cap):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@linear_softcap.register_kernel("cuda")
def _(x, weight, cap):
    from gemma4opt.kernels.softcap import softcap_

    return softcap_(F.linear(x, weight).contiguous(), cap)
