"""Every kernel that reads weight or scale vectors gives the same result when they are strided.

A parameter can get other strides after optimize() (``p.data = strided``); Dynamo then recompiles
with it, and a kernel indexing the vector as packed would read neighbouring memory instead. Each
case runs the kernel on strided vectors (every other element of a buffer whose other elements are
garbage) and on packed copies of the same values: the results must be identical.
"""
import pytest
import torch

from gemma4opt.kernels.add_rms_norm import add_rms_norm_triton
from gemma4opt.kernels.fp8_quant import add_rms_norm_quant_triton, rms_norm_quant_triton
from gemma4opt.kernels.moe_router import router_input_triton, router_topk_triton
from gemma4opt.kernels.norm_add import norm_add_triton
from gemma4opt.kernels.norm_linear import norm_linear_triton
from gemma4opt.kernels.qkv_norm_rope_append import qkv_norm_rope_append_triton
from gemma4opt.kernels.rms_norm import rms_norm_triton
from gemma4opt.kernels.rms_norm_rope import rms_norm_rope_triton
from tests.kernels.conftest import DEVICE
from tests.kernels.test_qkv_norm_rope_append_kernel import _case
from tests.kernels.test_rms_norm_rope_kernel import _cos_sin

D = 48


def _strided(v: torch.Tensor) -> torch.Tensor:
    """v's values at stride 2, with 1e4 in between (what a packed read would pick up)."""
    buf = torch.full((2 * v.numel(),), 1e4, dtype=v.dtype, device=v.device)
    out = buf[::2]
    out.copy_(v)
    assert not out.is_contiguous() and torch.equal(out, v)
    return out


def _vec(n=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.3 * torch.randn(n, generator=g)).to(DEVICE)


def _rows(rows=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, D, generator=g) * 2).to(DEVICE)


CASES = {
    "rms_norm": (lambda w: rms_norm_triton(_rows(), w[0], 1e-6), 1),
    "add_rms_norm": (lambda w: add_rms_norm_triton(_rows(), _rows(seed=2), w[0], 1e-6, w[1], w[2], 1e-5), 3),
    "rms_norm_quant": (lambda w: rms_norm_quant_triton(_rows(), w[0], 1e-6), 1),
    "add_rms_norm_quant": (lambda w: add_rms_norm_quant_triton(_rows(), _rows(seed=2), w[0], 1e-6, w[1], w[2], 1e-5),
                           3),
    "norm_add": (lambda w: norm_add_triton(_rows(), w[0], 1e-6, _rows(seed=2), w[1], 1e-5, True), 2),
    "router_input": (lambda w: router_input_triton(_rows(), w[0], 1e-6, D ** -0.5, w[1], 1e-5), 2),
    "rms_norm_rope": (lambda w: rms_norm_rope_triton(_rows(6).view(2, 3, 3, 16), w[0][:16],
                                                     *_cos_sin(2, 3, 16, torch.float32), 1e-6), 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_strided_vectors_read_like_packed_ones(name):
    run, n = CASES[name]
    packed = [_vec(seed=i) for i in range(n)]
    want = run(packed)
    got = run([_strided(v) for v in packed])
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w), name


def test_router_topk_reads_a_strided_per_expert_scale():
    logits = _rows(4)[:, :8].contiguous()
    scale = _vec(8)
    want = router_topk_triton(logits, scale, 2)
    got = router_topk_triton(logits, _strided(scale), 2)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_qkv_norm_rope_append_reads_strided_q_and_k_weights():
    pool, args = _case(torch.float32, 2, 3, 4, 2, 32, 4, padded=1)
    q, wq, k, wk, *rest = args
    want_pool, got_pool = pool.clone(), pool.clone()
    want = qkv_norm_rope_append_triton(want_pool, q, wq, k, wk, *rest)
    got = qkv_norm_rope_append_triton(got_pool, q, _strided(wq), k, _strided(wk), *rest)
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)


def test_norm_linear_reads_strided_norm_weights():
    """The GEMM making the residual tail (bf16 only) reads both norm weights strided."""
    x, r, w = _rows(1).bfloat16(), _rows(1, seed=2).bfloat16(), _rows(7, seed=3).bfloat16()
    packed = [_vec(seed=i).bfloat16() for i in range(2)]
    scale = torch.tensor([0.7], device=DEVICE).bfloat16()

    def run(v):
        return norm_linear_triton(x, r, v[0], 1e-6, scale, v[1], 1e-5, w)

    want = run(packed)
    got = run([_strided(v) for v in packed])
    assert all(torch.equal(g, h) for g, h in zip(got, want))
