"""The one-launch decode router (kernels/moe_router_decode.py) against ops/moe_router.py's reference:
odd widths, expert counts that are not a multiple of the programs' blocks, several tokens, the
experts' norm from the same launch, and the count buffer left at zero (the next call, a graph
replay, starts from it). Run in the interpreter on CPU, compiled on the GPU."""
import pytest
import torch

from gemma4opt.kernels import moe_router_decode as rd
from gemma4opt.ops.moe_router import moe_router_reference
from gemma4opt.ops.rms_norm import rms_norm_reference
from tests.kernels.conftest import DEVICE, close


def _case(T, D, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * 3).to(dtype).to(DEVICE)
    scale = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    proj = (torch.randn(E, D, generator=g) * 2 / D ** 0.5).to(dtype).to(DEVICE)
    pes = (1 + 0.2 * torch.randn(E, generator=g)).to(DEVICE)
    w2 = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    return x, scale, proj, pes, w2


@pytest.mark.parametrize("T,D,E,k,block_e", [(1, 40, 6, 2, 1), (3, 130, 100, 4, 2), (5, 2816, 128, 8, 2),
                                             (2, 33, 9, 8, 4), (1, 70, 16, 1, 8)])
def test_fp32_matches_reference_exactly_in_its_choices(T, D, E, k, block_e):
    """fp32 rows: the same experts in the same order, the same probabilities and weights up to the
    sums' order; the experts' norm beside them."""
    x, scale, proj, pes, w2 = _case(T, D, E, torch.float32, seed=T * D + E)
    root = D ** -0.5
    probs, w, idx, n = rd.router_decode_triton(x, scale, proj, pes, 1e-6, root, k, w2, 1e-5,
                                               launch=dict(block_e=block_e))
    want_p, want_w, want_i = moe_router_reference(x, scale, proj, pes, 1e-6, root, k)
    assert torch.equal(idx, want_i)
    torch.testing.assert_close(probs, want_p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
    close(n, rms_norm_reference(x, w2, 1e-5), torch.float32)
    assert int(rd._COUNTS[x.device].abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_half_dtypes_and_repeat_calls(dtype, with_norm):
    """bf16 / fp16 rows (logits rounded as F.linear rounds them), called twice: the second call sees
    the counts the first left and gives the same result."""
    T, D, E, k = 4, 2816, 128, 8
    x, scale, proj, pes, w2 = _case(T, D, E, dtype, seed=11)
    root = D ** -0.5
    extra = (w2, 1e-6) if with_norm else ()
    first = rd.router_decode_triton(x, scale, proj, pes, 1e-6, root, k, *extra)
    second = rd.router_decode_triton(x, scale, proj, pes, 1e-6, root, k, *extra)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    want_p, want_w, want_i = moe_router_reference(x, scale, proj, pes, 1e-6, root, k)
    torch.testing.assert_close(first[0], want_p, rtol=2e-2, atol=1e-3)
    # A logit rounded the other way can swap two near-equal experts; the sets agree on nearly all.
    agree = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(first[2], want_i)) / want_i.numel()
    assert agree >= 0.9
    # The routing weights of every token whose experts came out the same, in the same order.
    same = [t for t in range(T) if torch.equal(first[2][t], want_i[t])]
    assert same
    torch.testing.assert_close(first[1][same], want_w[same], rtol=2e-2, atol=1e-3)
    if with_norm:
        close(first[3], rms_norm_reference(x, w2, 1e-6), dtype)


def test_supported_cases():
    x, scale, proj, pes, w2 = _case(2, 40, 6, torch.float32, seed=3)
    assert rd.router_decode_supported(x, scale, proj, 2, w2)
    many = x.new_zeros(rd.MAX_ROWS + 1, 40)
    assert not rd.router_decode_supported(many, scale, proj, 2)           # prefill rows: input + GEMM + tail
    assert not rd.router_decode_supported(x, scale.double(), proj, 2)     # mixed dtypes promote in eager
    assert not rd.router_decode_supported(x, scale, proj, 3)              # top-k not a power of two
    assert not rd.router_decode_supported(x, scale, proj.t().contiguous().t(), 2)
