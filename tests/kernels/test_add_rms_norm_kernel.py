import pytest
import torch

from gemma4opt.kernels.add_rms_norm import add_rms_norm_triton
from gemma4opt.ops.add_rms_norm import add_rms_norm_reference
from tests.kernels.conftest import DEVICE, DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 40), (3, 7, 96), (5, 130), (2, 0, 32)])
@pytest.mark.parametrize("with_scale", [True, False])
def test_matches_reference(dtype, shape, with_scale):
    x, r = (torch.randn(shape) * 2).to(dtype).to(DEVICE), torch.randn(shape).to(dtype).to(DEVICE)
    w1 = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).to(DEVICE)
    w2 = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).to(DEVICE)
    scale = torch.tensor([0.7], dtype=dtype, device=DEVICE) if with_scale else None
    got_s, got_n = add_rms_norm_triton(x, r, w1, 1e-6, scale, w2, 1e-5)
    want_s, want_n = add_rms_norm_reference(x, r, w1, 1e-6, scale, w2, 1e-5)
    assert got_s.shape == want_s.shape and got_s.dtype == dtype
    close(got_s, want_s, dtype)
    close(got_n, want_n, dtype)
