"""The skinny FP8 GEMM (kernels/fp8_linear.py) against ops/fp8.py's reference: dequantize, multiply
in fp32. Products of two e4m3 values are exact in fp32, so under the interpreter the two differ only
in fp32 sum order and where the scales are applied (once in the epilogue against once per element).
Compiled for sm_90 the fp8 MMA adds the 32 products of one instruction with fewer bits than fp32
(~14, DeepSeek-V3 §3.3.2); the kernel promotes each instruction's partial to fp32, so on the GPU the
error is bounded by 2^-12 of sum |x||w| (of each output) on top of the dtype's tolerance."""
import pytest
import torch
import triton

from gemma4opt.kernels.fp8_linear import MAX_ROWS, fp8_linear_triton, quant_fp8_linear_triton
from gemma4opt.ops.fp8 import (dequantize_rows_reference, fp8_linear_reference, quantize_rows_reference,
                               quantize_weight_reference)
from tests.kernels.conftest import DEVICE, DTYPES, close_fp8_mma


def _operands(rows, n, k, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed + rows * 1000 + n + k)
    x = torch.randn(*lead, rows, k, generator=g) * torch.rand(*lead, rows, 1, generator=g) * 4
    w = torch.randn(n, k, generator=g) / k ** 0.5 * torch.linspace(0.2, 2, n)[:, None]
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight_reference(w)
    return xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE)


def _want(xq, xs, wq, ws):
    """The reference's fp32 product (compared with the output dtype's tolerance)."""
    return fp8_linear_reference(xq, xs, wq, ws, torch.float32)


def close(got, xq, xs, wq, ws, out_dtype):
    """got against the reference: the dtype's tolerance, plus the fp8 MMA's bound where compiled."""
    close_fp8_mma(got, _want(xq, xs, wq, ws), dequantize_rows_reference(xq, xs), dequantize_rows_reference(wq, ws),
                  out_dtype)


_AOT = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gemma4opt.kernels.fp8_linear import _fp8_linear_kernel
sig = dict(X="*fp8e4nv", XS="*fp32", W="*fp8e4nv", WS="*fp32", Y="*bf16", P="*fp32", M="i32", N="i32", K="i32",
           sxm="i32", swn="i32", sym="i32", ROWS="i32")
consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, COMPILED=True, SWAP=True, PDL=False, CAP=0.0, PIPE=0)
sig.update({k: "constexpr" for k in consts})
kernel = triton.compile(ASTSource(fn=_fp8_linear_kernel, signature=sig, constexprs=consts),
                        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
ptx = kernel.asm["ptx"]
print(len(re.findall(r"wgmma\\.mma_async\\.\\S*e4m3\\.e4m3", ptx)), len(re.findall(r"add\\.f32", ptx)))
"""


def test_compiled_for_sm90_the_fp8_dot_is_wgmma_promoted_per_instruction():
    """Ahead of time, no GPU needed (a subprocess without the interpreter): the dot tile compiles to
    fp8 wgmma, not an fp16 upcast, and adds each instruction's partial in fp32 (4 instructions per
    128-long K tile, 8 accumulator registers each)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=300)
    # Only a Triton without its bundled ptxas cannot build the cubin here (as test_compiles_for_sm90.py);
    # any other error (a constexpr the kernel gained and this signature lacks) fails the test.
    if out.returncode and "No such file" in out.stderr and "ptxas" in out.stderr:
        pytest.skip("this triton has no bundled ptxas")
    assert out.returncode == 0, out.stderr[-2000:]
    wgmma, adds = map(int, out.stdout.split())
    assert wgmma == 4 and adds >= 4 * 8, out.stdout


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 40, 72), (1, 33, 200), (3, 40, 72), (17, 33, 200), (MAX_ROWS, 9, 40)])
def test_matches_reference(out_dtype, rows, n, k):
    xq, xs, wq, ws = _operands(rows, n, k)
    got = fp8_linear_triton(xq, xs, wq, ws, out_dtype)
    assert got.shape == (rows, n) and got.dtype == out_dtype
    close(got, xq, xs, wq, ws, out_dtype)


def test_keeps_leading_dims_and_reads_a_weight_row_block():
    """A decode step's [batch, 1, K] input and a merged weight's row block (full weight's row stride)."""
    xq, xs, wq, ws = _operands(1, 60, 72, lead=(4,))
    got = fp8_linear_triton(xq, xs, wq[10:50], ws[10:50], torch.bfloat16)
    assert got.shape == (4, 1, 40)
    close(got, xq, xs, wq[10:50], ws[10:50], torch.bfloat16)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("split", [1, 2, 3, 4])
@pytest.mark.parametrize("rows,n,k", [(2, 40, 72), (17, 70, 200)])
def test_explicit_tiles_transposed_or_split(swap, split, rows, n, k):
    """W rows as the dot's M side or x's rows; K unsplit or split (the last chunks short or empty:
    K = 72 is 3 tiles of 32 over 4 splits), N not a multiple of the tile; the split sum applies the scales."""
    xq, xs, wq, ws = _operands(rows, n, k, seed=split * 10 + swap)
    cfg = dict(BLOCK_N=16 if n < 64 else 64, BLOCK_K=32, SPLIT_K=split, SWAP=swap)
    close(fp8_linear_triton(xq, xs, wq, ws, torch.float32, cfg), xq, xs, wq, ws, torch.float32)


@pytest.mark.parametrize("block_m,split", [(16, 1), (16, 3), (32, 2)])
def test_one_row_through_the_dot_path(block_m, split):
    """One row padded to 16 or 32 for the tensor-core tile (its other rows masked), W rows as the
    dot's M side, unsplit or split: the reference's product."""
    xq, xs, wq, ws = _operands(1, 70, 200, seed=block_m + split)
    cfg = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32, SPLIT_K=split, SWAP=True)
    close(fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16, cfg), xq, xs, wq, ws, torch.bfloat16)


@pytest.mark.parametrize("rows,config", [(1, None), (1, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=2, SWAP=True)),
                                         (5, None)])
def test_softcap_epilogue(rows, config):
    """An fp8 lm_head's softcap as the epilogue (and in the split sum): the op's reference, the bf16
    logits through HF's /, tanh, * (here on logits scaled up so the cap bends them)."""
    from gemma4opt.ops.fp8_linear import softcapped

    xq, xs, wq, ws = _operands(rows, 70, 200, seed=7)
    xs = xs * 40
    got = fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16, config, cap=30.0)
    want = softcapped(fp8_linear_reference(xq, xs, wq, ws, torch.bfloat16), 30.0)
    assert want.abs().max() > 20, "the cap does not bend these logits"
    # one bf16 ulp of a logit near the cap is 0.125: the sum order may move the rounding by one
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=0.25)


def test_zero_rows_and_channels():
    """An all-zero token and an all-zero weight row (scales at their minimum) give exact zeros."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 72, generator=g), torch.randn(40, 72, generator=g)
    x[1], w[7] = 0, 0
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight_reference(w)
    xq, xs, wq, ws = xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE)
    got = fp8_linear_triton(xq, xs, wq, ws, torch.float32)
    assert (got[1] == 0).all() and (got[:, 7] == 0).all()
    close(got, xq, xs, wq, ws, torch.float32)


def test_refuses_what_it_cannot_run_and_empty_inputs():
    xq, xs, wq, ws = _operands(MAX_ROWS + 1, 8, 32)
    with pytest.raises(ValueError, match="at most 32"):
        fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16)
    xq, xs, wq, ws = _operands(2, 8, 32)
    with pytest.raises(ValueError, match="does not match"):
        fp8_linear_triton(xq[:, :16], xs, wq, ws, torch.bfloat16)
    with pytest.raises(ValueError, match="scales"):
        fp8_linear_triton(xq, xs[:1], wq, ws, torch.bfloat16)
    with pytest.raises(ValueError, match="at most 4 splits"):
        fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=8))
    with pytest.raises(ValueError, match="SWAP needs 2"):
        fp8_linear_triton(xq[:1], xs[:1], wq, ws, torch.bfloat16, dict(BLOCK_N=16, BLOCK_K=32, SWAP=True))
    with pytest.raises(ValueError, match="BLOCK_M=16 for 32 rows"):
        fp8_linear_triton(*_operands(MAX_ROWS, 8, 32), torch.bfloat16, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32))
    assert fp8_linear_triton(xq[:0], xs[:0], wq, ws, torch.bfloat16).shape == (0, 8)


@pytest.mark.parametrize("rows,classes", [(1, {1, 16}), (9, {16}), (MAX_ROWS, {32})])
def test_autotuned_launch_binds_every_parameter_and_tunes_per_row_class(monkeypatch, rows, classes):
    """The autotuned entry, with the kernel launch and its timing replaced (they need a GPU): every
    candidate and the final launch bind each kernel parameter, ROWS keys the row class, and the
    candidates are that class's tiles (one row: the row sums and the tensor-core tiles padded to 16)."""
    from gemma4opt.kernels import fp8_linear as k
    from tests.kernels.conftest import record_tuned_launches

    launches = record_tuned_launches(monkeypatch, k, k._tuned)
    xq, xs, wq, ws = _operands(rows, 40, 72)
    fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16)
    assert {b["ROWS"] for b in launches} == {1 if rows == 1 else 16 if rows <= 16 else 32}
    assert {b["BLOCK_M"] for b in launches[:-1]} == classes
    K = xq.shape[-1]        # the pipelined row sums only over more than one of their K tiles
    assert len(launches) == 1 + sum(c.kwargs["BLOCK_M"] in classes and k.pipe_offered(c, K) for c in k._tuned.configs)


# QUANT (quant_fp8_linear_triton): the GEMM quantizes its unquantized input itself. Its bytes and scales
# are quantize_rows' (ops/fp8.py), so its output is fp8_linear_triton's on quantize_rows(x) with the same
# tile: equal bits under the interpreter (one sum order); on the GPU the same bound as above.

def _unquantized(rows, n, k, dtype, seed=0, lead=()):
    xq, xs, wq, ws = _operands(rows, n, k, seed=seed, lead=lead)
    g = torch.Generator().manual_seed(seed + 5)
    x = (torch.randn(*lead, rows, k, generator=g) * torch.rand(*lead, rows, 1, generator=g) * 4).to(dtype)
    return x.to(DEVICE), wq, ws


def _quant_close(got, x, wq, ws, out_dtype, config=None):
    xq, xs = quantize_rows_reference(x)
    if DEVICE != "cuda":
        assert torch.equal(got, fp8_linear_triton(xq, xs, wq, ws, out_dtype, config))
    close(got, xq, xs, wq, ws, out_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(1, 40, 72), (1, 33, 2100), (3, 40, 72), (17, 33, 200), (MAX_ROWS, 9, 40)])
def test_quantizing_its_input_matches_quantize_rows_then_the_gemm(dtype, rows, n, k):
    """One row's amax pass over K longer than its 2048-column tile (2100), 2-32 rows through the dot
    tiles (the interpreter's default splits K in 2: the split sum reads the scales the kernel wrote)."""
    x, wq, ws = _unquantized(rows, n, k, dtype, seed=rows + n)
    got = quant_fp8_linear_triton(x, wq, ws, dtype)
    assert got.shape == (rows, n) and got.dtype == dtype
    _quant_close(got, x, wq, ws, dtype)


@pytest.mark.parametrize("config", [dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, SWAP=True),
                                    dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, SWAP=False),
                                    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=4, SWAP=True),
                                    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, SWAP=True)])
def test_quantizing_tiles_split_transposed_or_padded(config):
    """Each tile kind with QUANT: split K (every split recomputes the scales from all of K), x's rows as
    the dot's M side, one row padded to 16 or 32 (the masked rows quantize to zeros)."""
    rows = 1 if "BLOCK_M" in config else 5
    x, wq, ws = _unquantized(rows, 70, 200, torch.bfloat16, seed=config["SPLIT_K"])
    got = quant_fp8_linear_triton(x, wq, ws, torch.bfloat16, config)
    _quant_close(got, x, wq, ws, torch.bfloat16, config)


def test_quantizing_keeps_leading_dims_a_zero_row_and_a_strided_weight():
    x, wq, ws = _unquantized(1, 60, 72, torch.bfloat16, seed=3, lead=(4,))
    x[2] = 0
    got = quant_fp8_linear_triton(x, wq[10:50], ws[10:50], torch.bfloat16)
    assert got.shape == (4, 1, 40) and (got[2] == 0).all()
    _quant_close(got.reshape(4, 40), x.reshape(4, 72), wq[10:50], ws[10:50], torch.bfloat16)


def test_quantizing_refuses_an_fp8_input_and_what_the_gemm_refuses():
    x, wq, ws = _unquantized(2, 8, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="not an unquantized float"):
        quant_fp8_linear_triton(x.to(torch.float8_e4m3fn), wq, ws, torch.bfloat16)
    with pytest.raises(ValueError, match="quant_fp8_linear: 33 rows, at most 32"):
        quant_fp8_linear_triton(x[:1].expand(MAX_ROWS + 1, 32), wq, ws, torch.bfloat16)
    with pytest.raises(ValueError, match="scales of 7 channels"):
        quant_fp8_linear_triton(x, wq, ws[:7], torch.bfloat16)
    assert quant_fp8_linear_triton(x[:0], wq, ws, torch.bfloat16).shape == (0, 8)


def test_quantizing_launch_is_tuned_apart_from_the_quantized_inputs(monkeypatch):
    """QUANT keys the autotuner: a shape tuned for fp8 inputs is tuned again for the quantizing launch,
    whose every candidate binds QUANT=True (the scales pass costs each tile its own time)."""
    from gemma4opt.kernels import fp8_linear as k
    from tests.kernels.conftest import record_tuned_launches

    launches = record_tuned_launches(monkeypatch, k, k._tuned)
    xq, xs, wq, ws = _operands(1, 40, 72)
    fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16)
    first = len(launches)
    quant_fp8_linear_triton(xq.float().to(torch.bfloat16), wq, ws, torch.bfloat16)
    assert len(launches) == 2 * first
    assert {b["QUANT"] for b in launches[:first]} == {False} and {b["QUANT"] for b in launches[first:]} == {True}
