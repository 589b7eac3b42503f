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


def test_block_fits_the_row():
    """Rows that split evenly into 1024-blocks keep them; a row that would leave most of its last
    block masked (the 26b-a4b's 2112) takes 256-blocks."""
    from gemma4opt.kernels.gelu_tanh_mul import _block

    assert _block(21504)[0] == 1024 and _block(10240)[0] == 1024
    assert _block(2112)[0] == 256 and _block(24)[0] == 256
