import pytest
import torch

from gemma4opt.kernels.moe_router import router_topk_triton
from tests.kernels.conftest import DEVICE


@pytest.mark.parametrize("T,E,K", [(1, 4, 2), (5, 128, 8), (3, 100, 4), (0, 8, 2)])
def test_matches_torch(T, E, K):
    logits = torch.randn(T, E, device=DEVICE) * 3
    pes = (1 + 0.2 * torch.randn(E)).to(DEVICE)
    probs, w, idx = router_topk_triton(logits, pes, K)
    want_p = torch.softmax(logits.float(), -1)
    want_w, want_i = torch.topk(want_p, K, dim=-1)
    want_w = want_w / want_w.sum(-1, keepdim=True) * pes[want_i]
    torch.testing.assert_close(probs, want_p, rtol=1e-5, atol=1e-6)
    assert torch.equal(idx, want_i)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
