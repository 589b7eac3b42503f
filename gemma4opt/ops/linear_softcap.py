"""gemma4opt::linear_softcap — lm_head GEMM with the logit softcap applied to its output.

    logits = tanh(linear(x, weight) / cap) * cap

On CUDA with at most ``MAX_ROWS`` rows (decode) each shape runs whichever was faster on its first
call (ops/pick.py, as ``gemma4opt.linear``): the skinny Triton GEMM with the softcap as its
epilogue (one kernel, the logits written once), or cuBLAS then the softcap kernel in place on its
output. More rows (prefill): cuBLAS then the softcap kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gemma4opt.ops.pick import check_then_time
from gemma4opt.ops.state import picks_api, picks_for

MAX_ROWS = 32


# Picks: (rows, N, K, dtype, device index) -> the Triton GEMM + epilogue, per optimized model (ops/state.py).
picks, failures = picks_api("linear_softcap")


@torch.library.custom_op("gemma4opt::linear_softcap", mutates_args=())
def linear_softcap(x: torch.Tensor, weight: torch.Tensor, cap: float) -> torch.Tensor:
    return linear_softcap_reference(x, weight, cap)


def linear_softcap_reference(x, weight, cap):
    return torch.tanh(F.linear(x, weight) / cap) * cap


@linear_softcap.register_fake
def _(x, weight, cap):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _cublas_softcap(x, weight, cap):
    from gemma4opt.kernels.softcap import softcap_

    return softcap_(F.linear(x, weight).contiguous(), cap)


def _time_both(x, weight, cap) -> tuple[float, float]:
    from gemma4opt.kernels.skinny_linear import skinny_linear_triton

    return check_then_time(lambda w: skinny_linear_triton(x, w, cap=cap), lambda w: _cublas_softcap(x, w, cap), weight,
                           "skinny Triton GEMM + softcap", "cuBLAS + softcap")


def runs_triton(x, weight, cap) -> bool:
    """Whether this CUDA call runs the skinny GEMM with the softcap epilogue: decode rows,
    unit-stride weight rows, and a shape the active model's picks give to Triton (timed now if new)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not (0 < rows <= MAX_ROWS and weight.stride(-1) == 1):
        return False
    key = (rows, weight.shape[0], weight.shape[1], x.dtype, x.device.index)
    return picks_for("linear_softcap").pick(key, lambda: _time_both(x, weight, cap))


@linear_softcap.register_kernel("cuda")
def _(x, weight, cap):
    if runs_triton(x, weight, cap):
        from gemma4opt.kernels.skinny_linear import skinny_linear_triton

        return skinny_linear_triton(x, weight, cap=cap)
    return _cublas_softcap(x, weight, cap)
