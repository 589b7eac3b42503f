import pytest
import torch

from gemma4opt.kernels.softcap import softcap_
from gemma4opt.ops.linear_softcap import linear_softcap_reference
from tests.kernels.conftest import DEVICE, DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 16, 50), (3, 32, 4099), (0, 8, 8)])
def test_linear_then_softcap_matches_reference(dtype, M, K, N):
    x = torch.randn(M, K).to(dtype).to(DEVICE)
    w = (torch.randn(N, K) * 2).to(dtype).to(DEVICE)
    got = softcap_(torch.nn.functional.linear(x, w).contiguous(), 30.0)
    close(got, linear_softcap_reference(x, w, 30.0), dtype)
    assert got.abs().max() <= 30.0 if got.numel() else True
