"""The skinny FP8 GEMM (kernels/fp8_linear.py) against ops/fp8.py's reference: dequantize, multiply
in fp32. Products of two e4m3 values are exact in fp32, so the two differ only in fp32 sum order
and where the scales are applied (once in the epilogue against once per element)."""
import pytest
import torch

from gemma4opt.kernels.fp8_linear import MAX_ROWS, fp8_linear_triton
from gemma4opt.ops.fp8 import fp8_linear_reference, quantize_rows_reference, quantize_weight_reference
from tests.kernels.conftest import DEVICE, DTYPES, close


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


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 40, 72), (1, 33, 200), (3, 40, 72), (17, 33, 200), (MAX_ROWS, 9, 40)])
def test_matches_reference(out_dtype, rows, n, k):
    xq, xs, wq, ws = _operands(rows, n, k)
    got = fp8_linear_triton(xq, xs, wq, ws, out_dtype)
    assert got.shape == (rows, n) and got.dtype == out_dtype
    close(got, _want(xq, xs, wq, ws), out_dtype)


def test_keeps_leading_dims_and_reads_a_weight_row_block():
    """A decode step's [batch, 1, K] input and a merged weight's row block (full weight's row stride)."""
    xq, xs, wq, ws = _operands(1, 60, 72, lead=(4,))
    got = fp8_linear_triton(xq, xs, wq[10:50], ws[10:50], torch.bfloat16)
    assert got.shape == (4, 1, 40)
    close(got, _want(xq, xs, wq[10:50], ws[10:50]), torch.bfloat16)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("split", [1, 2, 3, 4])
@pytest.mark.parametrize("rows,n,k", [(2, 40, 72), (17, 70, 200)])
def test_explicit_tiles_transposed_or_split(swap, split, rows, n, k):
    """W rows as the dot's M side or x's rows; K unsplit or split (the last chunks short or empty:
    K = 72 is 3 tiles of 32 over 4 splits), N not a multiple of the tile; the split sum applies the scales."""
    xq, xs, wq, ws = _operands(rows, n, k, seed=split * 10 + swap)
    cfg = dict(BLOCK_N=16 if n < 64 else 64, BLOCK_K=32, SPLIT_K=split, SWAP=swap)
    close(fp8_linear_triton(xq, xs, wq, ws, torch.float32, cfg), _want(xq, xs, wq, ws), torch.float32)


def test_zero_rows_and_channels():
    """An all-zero token and an all-zero weight row (scales at their minimum) give exact zeros."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 72, generator=g), torch.randn(40, 72, generator=g)
    x[1], w[7] = 0, 0
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight_reference(w)
    got = fp8_linear_triton(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), torch.float32).cpu()
    assert (got[1] == 0).all() and (got[:, 7] == 0).all()
    close(got, fp8_linear_reference(xq, xs, wq, ws, torch.float32), torch.float32)


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
    assert fp8_linear_triton(xq[:0], xs[:0], wq, ws, torch.bfloat16).shape == (0, 8)
