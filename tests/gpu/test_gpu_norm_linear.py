"""On the GPU machine: the residual tail made inside the one-row GEMM (kernels/norm_linear.py),
compiled, at the presets' shapes: against the two kernels it replaces, every tile kind, the op's
pick and a CUDA graph replay."""
import pytest
import torch
import triton

from gemma4opt.kernels.add_rms_norm import add_rms_norm_triton
from gemma4opt.kernels.norm_add import norm_add_triton
from gemma4opt.kernels.norm_linear import norm_linear_triton
from gemma4opt.kernels.skinny_linear import skinny_linear_triton
from gemma4opt.ops import norm_linear as op

pytestmark = pytest.mark.gpu

# (N, K): the e4b's merged q/k/v (sliding) and q only (KV-shared), its per-layer-input gate, the
# 26b-a4b's q/k/v, the e2b's q/k/v, the 31b's q/k/v (sliding); an odd one.
SHAPES = [(3072, 2560), (2048, 2560), (256, 2560), (8192, 2816), (2560, 1536), (16384, 5376), (1000, 4000)]


def _inputs(n, k, seed, scale=True, nxt=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(1, 1, k, device="cuda", generator=g) * 3).bfloat16()
    r = torch.randn(1, 1, k, device="cuda", generator=g).bfloat16()
    w1 = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    w2 = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).bfloat16() if nxt else None
    sc = torch.tensor([0.8], device="cuda").bfloat16() if scale else None
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    return x, r, w1, sc, w2, w


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("tile", ["tuned", "loop", "whole", "split"])
def test_layer_tail_matches_the_two_kernels(n, k, tile):
    """s: add_rms_norm's bits, or at most one bf16 step off where the norm's sum added in another
    order; y: the skinny GEMM of the tail kernel's n on the same tile, to bf16 rounding."""
    x, r, w1, sc, w2, w = _inputs(n, k, n + k)
    config = {"tuned": None, "loop": dict(BLOCK_N=4, BLOCK_K=512), "split": dict(BLOCK_N=4, BLOCK_K=512, SPLIT_K=2),
              "whole": dict(BLOCK_N=1, BLOCK_K=triton.next_power_of_2(k), num_warps=8, num_stages=1)}[tile]
    s, y = norm_linear_triton(x, r, w1, 1e-6, sc, w2, 1e-6, w, config)
    want_s, want_n = add_rms_norm_triton(x, r, w1, 1e-6, sc, w2, 1e-6)
    assert (s.float() - want_s.float()).abs().max() <= want_s.float().abs().max() * 2 ** -7
    want_y = skinny_linear_triton(want_n, w, config)
    torch.testing.assert_close(y.float(), want_y.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,k", [(256, 2560), (2560, 1536)])
def test_mlp_tail_matches_norm_add_then_the_gemm(n, k):
    x, r, w1, _, _, w = _inputs(n, k, 7 * n, scale=False, nxt=False)
    s, y = norm_linear_triton(x, r, w1, 1e-6, None, None, 1e-6, w)
    want_s = norm_add_triton(x, w1, 1e-6, r, None, 1e-6, False)
    assert (s.float() - want_s.float()).abs().max() <= want_s.float().abs().max() * 2 ** -7
    torch.testing.assert_close(y.float(), skinny_linear_triton(want_s, w).float(), rtol=2e-2, atol=2e-2)


def test_op_picks_then_replays_in_a_graph():
    """The op's first call times both paths (a pick for its key), later calls and a CUDA graph replay
    with new inputs give the reference's values to bf16 rounding."""
    n, k = 3072, 2560
    x, r, w1, sc, w2, w = _inputs(n, k, 11)
    s, y = torch.ops.gemma4opt.norm_linear(x, r, w1, 1e-6, sc, w2, 1e-6, w)
    assert (1, n, k, True, True, torch.bfloat16, 0) in op.picks()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gs, gy = torch.ops.gemma4opt.norm_linear(x, r, w1, 1e-6, sc, w2, 1e-6, w)
    x.copy_(torch.randn_like(x) * 2)
    graph.replay()
    want_s, want_y = op.norm_linear_reference(x, r, w1, 1e-6, sc, w2, 1e-6, w)
    torch.testing.assert_close(gs.float(), want_s.float(), rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(gy.float(), want_y.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,k", [(3072, 2560), (2048, 2560), (8192, 2816), (16384, 5376)])
def test_fp8_layer_tail_matches_the_quant_kernel_then_the_fp8_gemm(n, k):
    """With fp8 weights: y against add_rms_norm_quant's bytes through the fp8 GEMM's row sums, the
    autotuned tile and one fixed tile; then the op's pick."""
    from gemma4opt.kernels.fp8_linear import fp8_linear_triton
    from gemma4opt.kernels.fp8_quant import add_rms_norm_quant_triton
    from gemma4opt.kernels.norm_fp8_linear import norm_fp8_linear_triton
    from gemma4opt.ops import norm_fp8_linear as fp8_op
    from gemma4opt.ops.fp8 import quantize_rows_reference

    x, r, w1, sc, w2, w = _inputs(n, k, 3 * n + k)
    wq, ws = quantize_rows_reference(w.float())
    want_s, q, qs = add_rms_norm_quant_triton(x, r, w1, 1e-6, sc, w2, 1e-6)
    for config in (None, dict(BLOCK_N=8, BLOCK_K=512)):
        s, y = norm_fp8_linear_triton(x, r, w1, 1e-6, sc, w2, 1e-6, wq, ws, torch.bfloat16, config)
        assert (s.float() - want_s.float()).abs().max() <= want_s.float().abs().max() * 2 ** -7
        want = fp8_linear_triton(q, qs, wq, ws, torch.bfloat16, config=config and dict(config, BLOCK_M=1))
        assert (y.float() - want.float()).norm() <= 2e-2 * want.float().norm()
    s, y = torch.ops.gemma4opt.norm_fp8_linear(x, r, w1, 1e-6, sc, w2, 1e-6, wq, ws, torch.bfloat16)
    assert (1, n, k, True, torch.bfloat16, 0) in fp8_op.picks()
    want = fp8_linear_triton(q, qs, wq, ws, torch.bfloat16)
    assert (y.float() - want.float()).norm() <= 2e-2 * want.float().norm()
