"""kernels/norm_fp8_linear.py: the one-row fp8 GEMM whose input is a residual tail quantized in the GEMM."""
import pytest
import torch

from gemma4opt.kernels.fp8_linear import fp8_linear_triton
from gemma4opt.kernels.fp8_quant import add_rms_norm_quant_triton
from gemma4opt.kernels.norm_fp8_linear import norm_fp8_linear_triton, supported
from gemma4opt.ops.add_rms_norm_quant import add_rms_norm_quant_reference
from gemma4opt.ops.fp8 import fp8_linear_reference, quantize_rows_reference
from tests.kernels.conftest import DEVICE


def _inputs(n, k, dtype, seed, with_scale):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, 1, k, generator=g) * 2).to(dtype).to(DEVICE)
    r = torch.randn(1, 1, k, generator=g).to(dtype).to(DEVICE)
    w1 = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    w2 = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    scale = torch.tensor([0.7], dtype=dtype, device=DEVICE) if with_scale else None
    wq, ws = quantize_rows_reference((torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE))
    return x, r, w1, scale, w2, wq, ws


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("block_k", [32, 64])
@pytest.mark.parametrize("n,k", [(7, 40), (33, 96), (130, 72)])
def test_is_the_tail_quant_kernel_then_the_fp8_gemm_bit_for_bit(dtype, with_scale, block_k, n, k):
    """s, and y against add_rms_norm_quant's bytes through the fp8 GEMM's row sums on the same tile:
    bit for bit; y close to the reference's dequantized product (as a whole row)."""
    x, r, w1, scale, w2, wq, ws = _inputs(n, k, dtype, n + k + block_k, with_scale)
    config = dict(BLOCK_N=4, BLOCK_K=block_k)
    s, y = norm_fp8_linear_triton(x, r, w1, 1e-6, scale, w2, 1e-5, wq, ws, dtype, config)
    want_s, q, qs = add_rms_norm_quant_triton(x, r, w1, 1e-6, scale, w2, 1e-5)
    assert s.shape == x.shape and y.shape == (1, 1, n) and y.dtype == dtype
    assert torch.equal(s, want_s)
    assert torch.equal(y, fp8_linear_triton(q, qs, wq, ws, dtype, config=config))
    ref_s, ref_q, ref_qs = add_rms_norm_quant_reference(x, r, w1, 1e-6, scale, w2, 1e-5)
    want = fp8_linear_reference(ref_q, ref_qs, wq, ws, dtype)
    # A row's n may differ from the reference's by a bf16 rounding, and its e4m3 byte by a step.
    assert (y.float() - want.float()).norm() <= 3e-2 * want.float().norm()


def test_a_row_past_4096_the_31bs_5376():
    """The 31b's hidden size, past the 4096 its first tiles held: the two kernels' bits."""
    x, r, w1, scale, w2, wq, ws = _inputs(5, 5376, torch.bfloat16, 19, True)
    config = dict(BLOCK_N=4, BLOCK_K=512)
    s, y = norm_fp8_linear_triton(x, r, w1, 1e-6, scale, w2, 1e-5, wq, ws, torch.bfloat16, config)
    want_s, q, qs = add_rms_norm_quant_triton(x, r, w1, 1e-6, scale, w2, 1e-5)
    assert torch.equal(s, want_s)
    assert torch.equal(y, fp8_linear_triton(q, qs, wq, ws, torch.bfloat16, config=config))


def test_the_next_norm_and_its_quantization_reach_y():
    x, r, w1, scale, w2, wq, ws = _inputs(16, 48, torch.bfloat16, 3, True)
    base = norm_fp8_linear_triton(x, r, w1, 1e-6, scale, w2, 1e-6, wq, ws, torch.bfloat16)[1]
    assert not torch.equal(norm_fp8_linear_triton(x, r, w1, 1e-6, scale, w2 * 3, 1e-6, wq, ws, torch.bfloat16)[1], base)
    assert not torch.equal(norm_fp8_linear_triton(x, r * 0, w1, 1e-6, scale, w2, 1e-6, wq, ws, torch.bfloat16)[1], base)


def test_supported_names_what_it_refuses():
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    wq = torch.randn(8, 16).to(torch.float8_e4m3fn)
    assert supported(x, wq, torch.bfloat16) is None
    assert "2 rows" in supported(torch.randn(2, 16, dtype=torch.bfloat16), wq, torch.bfloat16)
    assert "e4m3" in supported(x, torch.randn(8, 16, dtype=torch.bfloat16), torch.bfloat16)
    assert "one dtype" in supported(x, wq, torch.float32)
    with pytest.raises(ValueError, match="2 rows"):
        norm_fp8_linear_triton(torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(2, 16, dtype=torch.bfloat16),
                               torch.ones(16, dtype=torch.bfloat16), 1e-6, None, torch.ones(16, dtype=torch.bfloat16),
                               1e-6, wq, torch.ones(8), torch.bfloat16)
