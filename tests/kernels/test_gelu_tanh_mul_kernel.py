import pytest
import torch

from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton
from gemma4opt.ops.gelu_tanh_mul import gelu_tanh_mul_reference
from tests.kernels.conftest import DEVICE, DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 24), (3, 5, 1500), (7, 33), (0, 8), (2, 3, 2048), (2, 2112)])
def test_matches_reference(dtype, shape):
    g, u = (torch.randn(shape) * 3).to(dtype).to(DEVICE), torch.randn(shape).to(dtype).to(DEVICE)
    close(gelu_tanh_mul_triton(g, u), gelu_tanh_mul_reference(g, u), dtype)


def test_reads_halves_of_a_merged_gemm_output_in_place():
    gu = torch.randn(2, 3, 2 * 50, device=DEVICE)
    g, u = gu[..., :50], gu[..., 50:]
    assert not g.is_contiguous()
    close(gelu_tanh_mul_triton(g, u), gelu_tanh_mul_reference(g, u), torch.float32)


def test_large_inputs_saturate_tanh_without_nan():
    g = torch.tensor([[-80.0, -10.0, 0.0, 10.0, 80.0]], device=DEVICE)
    out = gelu_tanh_mul_triton(g, torch.ones_like(g))
    assert torch.isfinite(out).all()
    close(out, gelu_tanh_mul_reference(g, torch.ones_like(g)), torch.float32)


def test_launch_override_is_used_and_matches():
    """The sweep's forced launches (other blocks and warps, a row not a multiple of the block) give
    the same result as the default launch."""
    from gemma4opt.kernels import gelu_tanh_mul as gm

    gu = torch.randn(3, 2 * 2112, device=DEVICE)
    g, u = gu[:, :2112], gu[:, 2112:]           # strided halves of one merged output, as in the model
    want = gelu_tanh_mul_reference(g, u)
    for block, warps in ((256, 2), (512, 4), (64, 1), (2048, 4)):   # 2112 % 64 == 0: the per-row grid
        launch = dict(block=block, warps=warps)
        assert gm._block(3 * 2112, launch) == (block, warps)
        torch.testing.assert_close(gelu_tanh_mul_triton(g, u, launch=launch), want, rtol=1e-5, atol=1e-5)
    assert gm._block(1) == (512, 4) and gm._block(8192 * 21504) == (1024, 2)
