"""Triton RMSNorm against the reference (interpreter on CPU, the real kernel on CUDA)."""
import pytest
import torch

from gemma4opt.kernels.rms_norm import rms_norm_triton
from gemma4opt.ops.rms_norm import rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 16), (3, 5, 48), (7, 100), (2, 3, 4, 32), (0, 64)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_matches_reference(dtype, shape, with_weight):
    x = (torch.randn(shape) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).to(DEVICE) if with_weight else None
    got = rms_norm_triton(x, w, 1e-6)
    want = rms_norm_reference(x, w, 1e-6)
    assert got.dtype == x.dtype and got.shape == x.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def test_non_contiguous_input():
    x = torch.randn(6, 40, device=DEVICE).t()   # rows of stride != D
    got = rms_norm_triton(x, None, 1e-5)
    torch.testing.assert_close(got, rms_norm_reference(x, None, 1e-5), rtol=1e-5, atol=1e-5)


def test_eps_is_used():
    x = torch.full((2, 8), 1e-4, device=DEVICE)
    got = rms_norm_triton(x, None, 1.0)
    torch.testing.assert_close(got, rms_norm_reference(x, None, 1.0))
    assert got.abs().max() < 1e-3   # eps dominates: output ~ x, not ~1
