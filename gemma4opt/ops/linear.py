"""gemma4opt::linear — a decoder layer's bias-free projection, ``linear(x, weight)``.

On CUDA with at most ``MAX_ROWS`` rows (decode steps), each shape (rows, N, K, dtype) runs
whichever of gemma4opt's skinny Triton GEMM (kernels/skinny_linear.py) and cuBLAS (F.linear) was
faster when both were timed, cold in L2 as in a decode step, on that shape's first call (and only
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

from gemma4opt.ops.pick import ShapePicks, bench_cold, check_close

MAX_ROWS = 32
MARGIN = 0.98          # Triton must be at least 2 % faster to be picked
# (rows, N, K, dtype, device index) -> the Triton GEMM. A Triton GEMM that fails to compile or run
# (an unexpected GPU, say) leaves that shape on cuBLAS, and the report says why.
SHAPES = ShapePicks(MARGIN)
pick_triton, picks, failures = SHAPES.pick, SHAPES.picks, SHAPES.failures


@torch.library.custom_op("gemma4opt::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


@linear.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _time_both(x, weight) -> tuple[float, float]:
    from gemma4opt.kernels.skinny_linear import skinny_linear_triton

    check_close(skinny_linear_triton(x, weight), F.linear(x, weight), what="skinny Triton GEMM", other="cuBLAS")
    return bench_cold(lambda: skinny_linear_triton(x, weight)), bench_cold(lambda: F.linear(x, weight))


@linear.register_kernel("cuda")
def _(x, weight):
    rows = x.numel() // max(x.shape[-1], 1)
    if 0 < rows <= MAX_ROWS and weight.stride(-1) == 1:
        key = (rows, weight.shape[0], weight.shape[1], x.dtype, x.device.index)
        if pick_triton(key, lambda: _time_both(x, weight)):
            from gemma4opt.kernels.skinny_linear import skinny_linear_triton

            return skinny_linear_triton(x, weight)
    return F.linear(x, weight)
