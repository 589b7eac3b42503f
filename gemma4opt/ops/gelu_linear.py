"""gemma4opt::gelu_linear — a GEMM whose input is a gelu·mul, one op:

    y = gemma4opt.linear(gemma4opt.gelu_tanh_mul(gate, up), W)       # an MLP's down, the PLE projection

On CUDA with at most 32 rows (decode) each shape runs whichever was faster when both were timed as
a decode step runs them (ops/pick.py's time_in_graph), on its first call, and only if their results
matched: the skinny Triton GEMM making gelu_tanh(gate) * up tile by tile as it reads its input
(kernels/skinny_linear.py, one launch; the same roundings as the gelu·mul kernel, so the same
input bits) or the two ops above (two launches, the GEMM its own pick). More rows, other shapes
(``up`` broadcast) and CPU: the two ops.

gemma4opt::gate_up_gelu_linear is a dense MLP after gate_up_gelu, ``linear(gate_up_gelu(x, W_gu), W_down)``:
its gate/up either ends in the fused GEMV's epilogue or, where that lost its pick, in the down GEMM.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.pick import check_then_time
from gemma4opt.ops.state import picks_api, picks_for

MAX_ROWS = 32

picks, failures = picks_api("gelu_linear")


@torch.library.custom_op("gemma4opt::gelu_linear", mutates_args=())
def gelu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gelu_linear_reference(gate, up, weight)


def gelu_linear_reference(gate, up, weight):
    """The ops it replaced, as the unfused graph calls them."""
    return torch.ops.gemma4opt.linear(torch.ops.gemma4opt.gelu_tanh_mul(gate, up), weight)


@gelu_linear.register_fake
def _(gate, up, weight):
    shape = torch.broadcast_shapes(gate.shape, up.shape)
    return gate.new_empty((*shape[:-1], weight.shape[0]))


def _time_both(gate, up, weight) -> tuple[float, float]:
    from gemma4opt.kernels.skinny_linear import skinny_linear_triton

    return check_then_time(lambda w: skinny_linear_triton(gate, w, up=up),
                           lambda w: gelu_linear_reference(gate, up, w), weight,
                           "skinny GEMM of gelu·mul", "gelu_tanh_mul + gemma4opt.linear")


def runs_triton(gate, up, weight) -> bool:
    """Whether this CUDA call runs the fused GEMM: decode rows, gate and up of one shape, a 16-bit
    dtype, unit-stride weight rows, and a shape the active model's picks give to it (timed now if new)."""
    rows = gate.numel() // max(gate.shape[-1], 1)
    if not (0 < rows <= MAX_ROWS and gate.shape == up.shape and weight.stride(-1) == 1
            and gate.dtype in (torch.bfloat16, torch.float16) and up.dtype == gate.dtype == weight.dtype):
        return False
    key = (rows, weight.shape[0], weight.shape[1], gate.dtype, gate.device.index)
    return picks_for("gelu_linear").pick(key, lambda: _time_both(gate, up, weight))


@gelu_linear.register_kernel("cuda")
def _(gate, up, weight):
    if runs_triton(gate, up, weight):
        from gemma4opt.kernels.skinny_linear import skinny_linear_triton

        return skinny_linear_triton(gate, weight, up=up)
    return gelu_linear_reference(gate, up, weight)


@torch.library.custom_op("gemma4opt::gate_up_gelu_linear", mutates_args=())
def gate_up_gelu_linear(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return gate_up_gelu_linear_reference(x, w_gate_up, w_down)


def gate_up_gelu_linear_reference(x, w_gate_up, w_down):
    """A dense MLP as the graph calls it after gate_up_gelu: its fused gate/up + gelu·mul, then down."""
    return torch.ops.gemma4opt.linear(torch.ops.gemma4opt.gate_up_gelu(x, w_gate_up), w_down)


@gate_up_gelu_linear.register_fake
def _(x, w_gate_up, w_down):
    return x.new_empty((*x.shape[:-1], w_down.shape[0]))


@gate_up_gelu_linear.register_kernel("cuda")
def _(x, w_gate_up, w_down):
    """gate_up_gelu's pick first: where its fused GEMV (gelu·mul in the epilogue) runs, the down GEMM
    follows it; where it would run the gate/up GEMM then the gelu·mul kernel, the gelu·mul goes into
    the down GEMM instead (this op's own pick): two launches either way, where there were three."""
    from gemma4opt.ops import gate_up_gelu as gug

    if gug.runs_triton(x, w_gate_up):
        from gemma4opt.kernels.gate_up_gelu import gate_up_gelu_triton

        return torch.ops.gemma4opt.linear(gate_up_gelu_triton(x, w_gate_up), w_down)
    y = torch.ops.gemma4opt.linear(x, w_gate_up)
    i = w_gate_up.shape[0] // 2
    return torch.ops.gemma4opt.gelu_linear(y[..., :i], y[..., i:], w_down)


@torch.library.custom_op("gemma4opt::fp8_gate_up_gelu_linear", mutates_args=())
def fp8_gate_up_gelu_linear(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_gate_up: torch.Tensor,
                            gate_up_scale: torch.Tensor, w_down: torch.Tensor, down_scale: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
    return fp8_gate_up_gelu_linear_reference(x_fp8, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, out_dtype)


def fp8_gate_up_gelu_linear_reference(x_fp8, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, out_dtype):
    """A dense MLP with fp8 weights as the graph calls it after fp8_quant: the fp8 gate/up GEMM of the
    quantized norm, gelu·mul quantizing its output for the fp8 down GEMM."""
    gm = torch.ops.gemma4opt
    y = gm.fp8_linear(x_fp8, x_scale, w_gate_up, gate_up_scale, out_dtype)
    i = w_gate_up.shape[0] // 2
    q, s = gm.gelu_tanh_mul_quant(y[..., :i], y[..., i:])
    return gm.fp8_linear(q, s, w_down, down_scale, out_dtype)


@fp8_gate_up_gelu_linear.register_fake
def _(x_fp8, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, out_dtype):
    return x_fp8.new_empty((*x_fp8.shape[:-1], w_down.shape[0]), dtype=out_dtype)


# The fp8 MLP's fused path is one pick for the whole MLP (two weights, timed together).
fp8_picks, fp8_failures = picks_api("fp8_mlp")


def fp8_mlp_fused(x_fp8, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, out_dtype):
    """Two launches where the reference takes four (gate/up GEMM, the gelu's amax and quantize kernels,
    down GEMM): the gate/up GEMV on e4m3 weights with gelu·mul in its epilogue, which also writes each
    program's max |activation|, then the down GEMM quantizing the activation as it reads it, its scale
    from those maxima (kernels/gate_up_gelu.py, kernels/fp8_linear.py). One row."""
    from gemma4opt.kernels.fp8_linear import quant_fp8_linear_triton
    from gemma4opt.kernels.gate_up_gelu import gate_up_gelu_fp8_triton

    act, parts = gate_up_gelu_fp8_triton(x_fp8, x_scale, w_gate_up, gate_up_scale, out_dtype, amax=True)
    return quant_fp8_linear_triton(act, w_down, down_scale, out_dtype, amax_parts=parts.reshape(-1))


def runs_fp8_fused(x_fp8, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, out_dtype) -> bool:
    """Whether this CUDA call runs fp8_mlp_fused: one e4m3 row, e4m3 weights with unit stride on K, a
    16-bit output, and a shape the active model's picks give to it (timed now if new, both weights
    streamed from HBM on every call)."""
    from gemma4opt.kernels.gate_up_gelu import MAX_ROWS

    rows = x_fp8.numel() // max(x_fp8.shape[-1], 1)
    if not (0 < rows <= MAX_ROWS and x_fp8.dtype == w_gate_up.dtype == w_down.dtype == torch.float8_e4m3fn
            and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1 and w_gate_up.shape[0] % 2 == 0
            and w_down.shape[-1] == w_gate_up.shape[0] // 2 and out_dtype in (torch.bfloat16, torch.float16)):
        return False
    key = (rows, w_gate_up.shape[0], w_gate_up.shape[1], w_down.shape[0], out_dtype, x_fp8.device.index)

    def time_both():
        def run(fn):
            return lambda w: fn(x_fp8, x_scale, w[0], gate_up_scale, w[1], down_scale, out_dtype)
        return check_then_time(run(fp8_mlp_fused), run(fp8_gate_up_gelu_linear_reference), (w_gate_up, w_down),
                               "fp8 gate/up GEMV + quantizing down GEMM",
                               "fp8_linear + gelu_tanh_mul_quant + fp8_linear")

    return picks_for("fp8_mlp").pick(key, time_both)


@fp8_gate_up_gelu_linear.register_kernel("cuda")
def _(x_fp8, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, out_dtype):
    args = (x_fp8, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, out_dtype)
    if runs_fp8_fused(*args):
        return fp8_mlp_fused(*args)
    return fp8_gate_up_gelu_linear_reference(*args)
