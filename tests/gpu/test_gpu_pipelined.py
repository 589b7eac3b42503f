"""On the GPU machine: the one-row GEMMs' pipelined row sums (PIPE: the K loop's loads staged through
shared memory, kernels/skinny_linear.py's _ROW_PIPE) load and sum what the plain loop does, in the same
order: the same bits, at the presets' shapes, bf16, fp8 and with the residual tail."""
import pytest
import torch

from gemma4opt.kernels.fp8_linear import fp8_linear_triton
from gemma4opt.kernels.norm_fp8_linear import norm_fp8_linear_triton
from gemma4opt.kernels.norm_linear import norm_linear_triton
from gemma4opt.kernels.skinny_linear import skinny_linear_triton
from gemma4opt.ops.fp8 import quantize_rows_reference

pytestmark = pytest.mark.gpu

# (N, K): the e4b's q/k/v and MLP down, its per-layer-input gate, the 31b's o_proj; an odd one.
SHAPES = [(3072, 2560), (2560, 10240), (256, 2560), (5376, 8192), (1000, 4000)]
TILES = [dict(BLOCK_N=4, BLOCK_K=512), dict(BLOCK_N=16, BLOCK_K=512, num_warps=8), dict(BLOCK_N=8, BLOCK_K=1024),
         dict(BLOCK_N=4, BLOCK_K=512, SPLIT_K=2)]


def _rand(*shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("tile", range(len(TILES)))
@pytest.mark.parametrize("gelu", [False, True])
def test_skinny_pipelined_is_the_plain_loops_bits(n, k, tile, gelu):
    x = _rand(1, k, seed=n + k).bfloat16()
    up = _rand(1, k, seed=n - k).bfloat16() if gelu else None
    w = (_rand(n, k, seed=n * k) / k ** 0.5).bfloat16()
    cfg = dict(TILES[tile], num_stages=3)
    assert torch.equal(skinny_linear_triton(x, w, dict(cfg, PIPE=3), up=up), skinny_linear_triton(x, w, cfg, up=up))


@pytest.mark.parametrize("n,k", SHAPES + [(16384, 5376)])
@pytest.mark.parametrize("bn,bk", [(8, 512), (16, 512), (8, 2048)])
def test_fp8_pipelined_is_the_plain_loops_bits(n, k, bn, bk):
    xq, xs = quantize_rows_reference(_rand(1, k, seed=k).bfloat16())
    wq, ws = quantize_rows_reference(_rand(n, k, seed=n) / k ** 0.5)
    cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=3)
    assert torch.equal(fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16, config=dict(cfg, PIPE=3)),
                       fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16, config=cfg))


@pytest.mark.parametrize("n,k", [(3072, 2560), (256, 2560), (16384, 5376)])
def test_residual_tail_gemms_pipelined_are_the_plain_loops_bits(n, k):
    x, r = (_rand(1, 1, k, seed=k) * 3).bfloat16(), _rand(1, 1, k, seed=k + 1).bfloat16()
    w1, w2 = (1 + 0.3 * _rand(k, seed=2)).bfloat16(), (1 + 0.3 * _rand(k, seed=3)).bfloat16()
    sc = torch.tensor([0.8], device="cuda").bfloat16()
    w = (_rand(n, k, seed=n) / k ** 0.5).bfloat16()
    cfg = dict(BLOCK_N=4, BLOCK_K=512, num_stages=3)
    got = norm_linear_triton(x, r, w1, 1e-6, sc, w2, 1e-6, w, dict(cfg, PIPE=3))
    want = norm_linear_triton(x, r, w1, 1e-6, sc, w2, 1e-6, w, cfg)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    wq, ws = quantize_rows_reference(w.float())
    got = norm_fp8_linear_triton(x, r, w1, 1e-6, sc, w2, 1e-6, wq, ws, torch.bfloat16, dict(cfg, PIPE=3))
    want = norm_fp8_linear_triton(x, r, w1, 1e-6, sc, w2, 1e-6, wq, ws, torch.bfloat16, cfg)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_moe_decode_kernels_pipelined_are_the_plain_loops_bits(tokens, fp8):
    """The 26b-a4b's experts (128 x [1408, 2816] / [2816, 704]), pair by pair: gate/up and down
    pipelined (gu_pipe / dn_pipe) against their plain loops, on each path's default tiles."""
    from gemma4opt.kernels.moe_experts import moe_experts_triton

    E, H, I, k = 128, 2816, 704, 8
    gu, dn = _rand(E, 2 * I, H, seed=1).bfloat16() / H ** 0.5, _rand(E, H, I, seed=2).bfloat16() / I ** 0.5
    scales = ()
    if fp8:
        (gu, gu_s), (dn, dn_s) = quantize_rows_reference(gu), quantize_rows_reference(dn)
        scales = (gu_s, dn_s)
    x = _rand(tokens, H, seed=3).bfloat16()
    g = torch.Generator(device="cuda").manual_seed(tokens)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(tokens)])
    wt = torch.softmax(_rand(tokens, k, seed=4), -1)
    got = moe_experts_triton(x, idx, wt, gu, dn, dict(gu_pipe=3, dn_pipe=3), *scales, grouped=False)
    assert torch.equal(got, moe_experts_triton(x, idx, wt, gu, dn, None, *scales, grouped=False))


@pytest.mark.parametrize("i,h", [(10240, 2560), (2112, 2816)])      # the e4b's and the 26b-a4b's dense MLPs
def test_gate_up_gelu_pipelined_is_the_plain_loops_bits(i, h):
    from gemma4opt.kernels.gate_up_gelu import gate_up_gelu_triton

    x, w = _rand(1, h, seed=h).bfloat16(), (_rand(2 * i, h, seed=i) / h ** 0.5).bfloat16()
    assert torch.equal(gate_up_gelu_triton(x, w, dict(gu_pipe=3)), gate_up_gelu_triton(x, w))
