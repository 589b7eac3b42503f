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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 40), (5, 130), (0, 32), (3, 2816)])
def test_router_input_matches_the_eager_ops(dtype, shape):
    """rms_norm (no weight) * scale * hidden ** -0.5 in one kernel, against ops/moe_router.py's
    op-by-op reference: odd widths, the 26b-a4b's hidden size, no tokens."""
    from gemma4opt.kernels.moe_router import router_input_triton
    from gemma4opt.ops.moe_router import _router_input
    from tests.kernels.conftest import close

    torch.manual_seed(shape[-1])
    x = (torch.randn(shape) * 3).to(dtype).to(DEVICE)
    scale = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).to(DEVICE)
    root = shape[-1] ** -0.5
    got = router_input_triton(x, scale, 1e-6, root)
    want = _router_input(x, scale, 1e-6, root)
    assert got.shape == want.shape and got.dtype == dtype
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 40), (5, 130), (0, 32)])
def test_router_input_with_the_experts_norm(dtype, shape):
    """The same pass also writes rms_norm(x, w2, eps2) (pre_feedforward_layernorm_2), its own eps."""
    from gemma4opt.kernels.moe_router import router_input_triton
    from gemma4opt.ops.moe_router import _router_input
    from gemma4opt.ops.rms_norm import rms_norm_reference
    from tests.kernels.conftest import close

    torch.manual_seed(shape[-1] + 1)
    x = (torch.randn(shape) * 3).to(dtype).to(DEVICE)
    scale = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).to(DEVICE)
    w2 = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).to(DEVICE)
    root = shape[-1] ** -0.5
    h, n = router_input_triton(x, scale, 1e-6, root, w2, 1e-5)
    close(h, _router_input(x, scale, 1e-6, root), dtype)
    close(n, rms_norm_reference(x, w2, 1e-5), dtype)
