"""kernels/norm_linear.py: the one-row GEMM whose input is a residual tail made in the GEMM."""
import pytest
import torch
import torch.nn.functional as F
import triton

from gemma4opt.kernels.add_rms_norm import add_rms_norm_triton
from gemma4opt.kernels.norm_add import norm_add_triton
from gemma4opt.kernels.norm_linear import MAX_K, norm_linear_triton, supported
from gemma4opt.kernels.skinny_linear import skinny_linear_triton
from gemma4opt.ops.add_rms_norm import add_rms_norm_reference
from gemma4opt.ops.norm_add import norm_add_reference
from tests.kernels.conftest import DEVICE, close

DTYPES16 = [torch.bfloat16, torch.float16]


def _inputs(k, n, dtype, seed, with_scale, next_norm):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, 1, k, generator=g) * 2).to(dtype).to(DEVICE)
    r = torch.randn(1, 1, k, generator=g).to(dtype).to(DEVICE)
    w1 = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    w2 = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype).to(DEVICE) if next_norm else None
    scale = torch.tensor([0.7], dtype=dtype, device=DEVICE) if with_scale else None
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    return x, r, w1, scale, w2, w


def _configs(k):
    """The interpreter's default (a K loop of 32-wide tiles), a split K, and the whole-row tile."""
    return [None, dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=2), dict(BLOCK_N=2, BLOCK_K=triton.next_power_of_2(k),
                                                               num_stages=1)]


@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("cfg", range(3))
@pytest.mark.parametrize("n,k", [(7, 40), (33, 96), (130, 72)])
def test_layer_tail_then_gemm_is_the_two_kernels_bits(dtype, with_scale, cfg, n, k):
    """With the next norm (a layer's end before the next q/k/v): s bit for bit add_rms_norm's, y bit
    for bit the skinny GEMM of its second output on the same tile; both close to the reference."""
    x, r, w1, scale, w2, w = _inputs(k, n, dtype, n + k + cfg, with_scale, True)
    config = _configs(k)[cfg]
    s, y = norm_linear_triton(x, r, w1, 1e-6, scale, w2, 1e-5, w, config)
    want_s, want_n = add_rms_norm_triton(x, r, w1, 1e-6, scale, w2, 1e-5)
    assert s.shape == x.shape and y.shape == (1, 1, n) and y.dtype == dtype
    assert torch.equal(s, want_s)
    assert torch.equal(y, skinny_linear_triton(want_n, w, config))
    ref_s, ref_n = add_rms_norm_reference(x, r, w1, 1e-6, scale, w2, 1e-5)
    close(s, ref_s, dtype)
    close(y, F.linear(ref_n.float(), w.float()).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("cfg", range(3))
@pytest.mark.parametrize("n,k", [(9, 40), (65, 100)])
def test_mlp_tail_then_gemm_is_the_two_kernels_bits(dtype, cfg, n, k):
    """Without the next norm (the MLP's end before the per-layer-input gate): s is norm_add's sum
    and the GEMM's input, bit for bit."""
    x, r, w1, _, _, w = _inputs(k, n, dtype, 3 * n + k + cfg, False, False)
    config = _configs(k)[cfg]
    s, y = norm_linear_triton(x, r, w1, 1e-6, None, None, 1e-6, w, config)
    want_s = norm_add_triton(x, w1, 1e-6, r, None, 1e-6, False)
    assert torch.equal(s, want_s)
    assert torch.equal(y, skinny_linear_triton(want_s, w, config))
    close(s, norm_add_reference(x, w1, 1e-6, r, None, 1e-6, False), dtype)


@pytest.mark.parametrize("next_norm", [True, False])
@pytest.mark.parametrize("config", [dict(BLOCK_N=4, BLOCK_K=512), dict(BLOCK_N=1, BLOCK_K=8192, num_stages=1)])
def test_a_row_past_4096_the_31bs_5376(next_norm, config):
    """The 31b's hidden size, past the 4096 its first tiles held: both tails, a K loop and the tile
    holding the whole row, the two kernels' bits."""
    k, n = 5376, 5
    x, r, w1, scale, w2, w = _inputs(k, n, torch.bfloat16, 17, next_norm, next_norm)
    s, y = norm_linear_triton(x, r, w1, 1e-6, scale, w2, 1e-6, w, config)
    if next_norm:
        want_s, want_n = add_rms_norm_triton(x, r, w1, 1e-6, scale, w2, 1e-6)
    else:
        want_s = want_n = norm_add_triton(x, w1, 1e-6, r, None, 1e-6, False)
    assert torch.equal(s, want_s)
    assert torch.equal(y, skinny_linear_triton(want_n, w, config))


def test_the_input_matters_at_every_step():
    """Each part of the tail reaches the outputs: the residual, the first norm's weight, the scale
    (into s: the next norm takes it out of y), the next norm's weight."""
    x, r, w1, scale, w2, w = _inputs(48, 16, torch.bfloat16, 5, True, True)
    base = norm_linear_triton(x, r, w1, 1e-6, scale, w2, 1e-6, w)
    for args in [(x, r * 0, w1, scale, w2), (x, r, w1 * 2, scale, w2), (x, r, w1, scale * 2, w2),
                 (x, r, w1, scale, w2 * 2)]:
        got = norm_linear_triton(args[0], args[1], args[2], 1e-6, args[3], args[4], 1e-6, w)
        assert not (torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]))


def test_supported_names_what_it_refuses():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert supported(torch.randn(1, 1, 16, dtype=torch.bfloat16), w) is None
    assert "2 rows" in supported(torch.randn(2, 16, dtype=torch.bfloat16), w)
    assert f"at most {MAX_K}" in supported(torch.randn(1, MAX_K + 8, dtype=torch.bfloat16),
                                          torch.randn(8, MAX_K + 8, dtype=torch.bfloat16))
    assert "unit stride" in supported(torch.randn(1, 16, dtype=torch.bfloat16), torch.randn(16, 8).t().bfloat16())
    assert "bf16 or fp16" in supported(torch.randn(1, 16), torch.randn(8, 16))
    with pytest.raises(ValueError, match="2 rows"):
        norm_linear_triton(torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(2, 16, dtype=torch.bfloat16),
                           torch.ones(16, dtype=torch.bfloat16), 1e-6, None, None, 1e-6, w)
