import pytest
import torch

from gemma4opt.kernels.softcap import softcap_
from gemma4opt.ops.linear_softcap import linear_softcap_reference
from tests.kernels.conftest import DEVICE, DTYPES, close

CAP = 30.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 16, 50), (3, 32, 4099), (0, 8, 8)])
def test_linear_then_softcap_matches_reference(dtype, M, K, N):
    x = torch.randn(M, K).to(dtype).to(DEVICE)
    w = (torch.randn(N, K) * 8).to(dtype).to(DEVICE)
    raw = torch.nn.functional.linear(x, w).contiguous()
    if raw.numel():
        # The logits go well past the cap, so the comparison below sees the cap bend them.
        assert raw.float().abs().max() > 2 * CAP
    got = softcap_(raw.clone(), CAP)
    close(got, linear_softcap_reference(x, w, CAP), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_bends_large_logits_to_the_cap(dtype):
    """tanh(x / cap) * cap on values far inside and far outside the cap: a kernel that stored
    x unchanged (no cap) or clamped it (no tanh) fails here."""
    raw = torch.tensor([-1000.0, -100.0, -30.0, -10.0, -1.0, 0.0, 1.0, 10.0, 30.0, 100.0, 1000.0])
    raw = raw.to(dtype).to(DEVICE)
    got = softcap_(raw.clone(), CAP).float().cpu()
    want = CAP * torch.tanh(raw.float().cpu() / CAP)
    close(got, want, dtype)
    assert got[0] < -29.0 and got[-1] > 29.0                      # ±1000 land just inside ±30
    assert 22.0 < got[8].item() < 23.5                             # 30 -> 30·tanh(1) = 22.85, not 30
