"""gemma4opt::gate_up_gelu — a dense MLP's merged gate/up projection and its gelu·mul, one op:

    act = gelu(linear(x, W)[..., :I], approximate="tanh") * linear(x, W)[..., I:]     # W [2I, H]

On CUDA at one row (a decode step of one sequence) each shape runs whichever was faster when both
were timed as a decode step runs them (ops/pick.py's time_in_graph), on its first call, and only
if their results matched: the Triton GEMV with gelu·mul in its epilogue (kernels/gate_up_gelu.py,
one launch) or what the op replaced, ``gemma4opt.linear`` (its own pick of GEMM) then
``gemma4opt.gelu_tanh_mul`` (two launches). More rows, and off CUDA: the replaced ops.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.pick import check_then_time
from gemma4opt.ops.state import picks_api, picks_for


picks, failures = picks_api("gate_up_gelu")


@torch.library.custom_op("gemma4opt::gate_up_gelu", mutates_args=())
def gate_up_gelu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gate_up_gelu_reference(x, weight)


def gate_up_gelu_reference(x, weight):
    """The ops it replaced, as the unfused graph calls them (on CPU: F.linear, then HF's gelu·mul)."""
    y = torch.ops.gemma4opt.linear(x, weight)
    i = weight.shape[0] // 2
    return torch.ops.gemma4opt.gelu_tanh_mul(y[..., :i], y[..., i:])


@gate_up_gelu.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def _time_both(x, weight) -> tuple[float, float]:
    from gemma4opt.kernels.gate_up_gelu import gate_up_gelu_triton

    return check_then_time(lambda w: gate_up_gelu_triton(x, w), lambda w: gate_up_gelu_reference(x, w), weight,
                           "Triton gate/up GEMV + gelu·mul", "gemma4opt.linear + gelu_tanh_mul")


def runs_triton(x, weight) -> bool:
    """Whether this CUDA call runs the fused kernel: one row, a 16-bit dtype, a merged weight with
    unit stride on H, and a shape the active model's picks give to it (timed now if new)."""
    from gemma4opt.kernels.gate_up_gelu import MAX_ROWS

    rows = x.numel() // max(x.shape[-1], 1)
    if not (0 < rows <= MAX_ROWS and weight.stride(-1) == 1 and weight.shape[0] % 2 == 0
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype):
        return False
    key = (rows, weight.shape[0], weight.shape[1], x.dtype, x.device.index)
    return picks_for("gate_up_gelu").pick(key, lambda: _time_both(x, weight))


@gate_up_gelu.register_kernel("cuda")
def _(x, weight):
    if runs_triton(x, weight):
        from gemma4opt.kernels.gate_up_gelu import gate_up_gelu_triton

        return gate_up_gelu_triton(x, weight)
    return gate_up_gelu_reference(x, weight)

