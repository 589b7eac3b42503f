"""gemma4opt::linear — a decoder layer's bias-free projection, ``linear(x, weight)``.

On CUDA with at most ``MAX_ROWS`` rows (decode steps), each shape (rows, N, K, dtype) runs
whichever of gemma4opt's skinny Triton GEMM (kernels/skinny_linear.py) and cuBLAS (F.linear) was
faster when both were timed as a decode step runs them (back to back in a CUDA graph, weights
streamed from HBM: ops/pick.py's time_in_graph), on that shape's first call (and only
if its result matched cuBLAS's to 16-bit rounding on the model's own weights there). Decode
graphs make that call eagerly before they capture, so a replay never times anything; a shape first
seen inside a capture takes cuBLAS. Why a pick per shape and not a rule: on an H200
(``bench_kernels.py --linear``, run ``2026-11-30/linear`` in benchmarks/results/kernels_h200.jsonl)
the Triton GEMM was 0.99-1.09x cuBLAS on the 31b's GEMMs at one row and 1.13-1.53x on every e4b
GEMM at one row, while at 32 rows cuBLAS was up to 1.14x faster on the e4b's sliding q/k/v and
o_proj. Ties go to cuBLAS, whose sums are the ones HF's own GEMM makes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gemma4opt.ops.pick import check_then_time
from gemma4opt.ops.state import picks_api, picks_for

MAX_ROWS = 32


# Picks: (rows, N, K, dtype, device index) -> the Triton GEMM, kept per optimized model
# (ops/state.py). A Triton GEMM that fails to compile or run (an unexpected GPU, say) leaves that
# shape on cuBLAS, and the report says why.
picks, failures = picks_api("linear")


@torch.library.custom_op("gemma4opt::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


@linear.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _time_both(x, weight) -> tuple[float, float]:
    from gemma4opt.kernels.skinny_linear import skinny_linear_triton

    return check_then_time(lambda w: skinny_linear_triton(x, w), lambda w: F.linear(x, w), weight,
                           "skinny Triton GEMM", "cuBLAS")


def runs_triton(x, weight) -> bool:
    """Whether this CUDA call runs the skinny Triton GEMM: decode rows, unit-stride weight rows,
    and a shape the active model's picks give to Triton (timed now if new)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not (0 < rows <= MAX_ROWS and weight.stride(-1) == 1):
        return False
    key = (rows, weight.shape[0], weight.shape[1], x.dtype, x.device.index)
    return picks_for("linear").pick(key, lambda: _time_both(x, weight))


@linear.register_kernel("cuda")
def _(x, weight):
    if runs_triton(x, weight):
        from gemma4opt.kernels.skinny_linear import skinny_linear_triton

        return skinny_linear_triton(x, weight)
    return F.linear(x, weight)
