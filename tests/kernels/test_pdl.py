"""Programmatic dependent launch: when gemma4opt's kernels ask for it, and (on the GPU machine)
that a CUDA-graph chain of PDL kernels, each reading the one before and overwriting what an
earlier one read, gives bit-for-bit the plain launches' result."""
import pytest
import torch

from gemma4opt.kernels import _util
from gemma4opt.kernels.add_rms_norm import add_rms_norm_triton
from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton
from gemma4opt.kernels.rms_norm import rms_norm_triton
from gemma4opt.kernels.skinny_linear import skinny_linear_triton
from gemma4opt.kernels.softcap import softcap_


@pytest.fixture
def restore_pdl():
    yield
    _util.set_pdl(_util.PDL_DEFAULT)


def test_no_pdl_off_the_gpu_or_when_turned_off(restore_pdl):
    x = torch.empty(4)
    _util.set_pdl(True)
    assert _util.pdl_flags(x) == {"PDL": False}        # CPU tensors (the interpreter) never launch with it
    if torch.cuda.is_available():
        xc = x.cuda()
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert _util.pdl_flags(xc) == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
        _util.set_pdl(False)
        assert _util.pdl_flags(xc) == {"PDL": False}


def _chain(x, r, w, gu_w, down_w, buf):
    """A decode-like chain: norm -> GEMM -> gelu.mul -> GEMM (into a reused buffer) -> add+norm -> softcap."""
    h = rms_norm_triton(x, w, 1e-6)
    gu = skinny_linear_triton(h, gu_w)
    act = gelu_tanh_mul_triton(gu[:, :gu.shape[1] // 2], gu[:, gu.shape[1] // 2:])
    buf.copy_(skinny_linear_triton(act, down_w))
    s, n = add_rms_norm_triton(buf, r, w, 1e-6, None, w, 1e-6)
    return softcap_(n.clone(), 30.0), s


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_graph_chain_same_bits_with_and_without_pdl(rows, restore_pdl):
    torch.manual_seed(rows)
    H, I = 1024, 1536
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
    gu_w = (torch.randn(2 * I, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    down_w = (torch.randn(H, I, device="cuda") / I ** 0.5).to(torch.bfloat16)
    outs = {}
    for pdl in (False, True):
        _util.set_pdl(pdl)
        buf = torch.empty(rows, H, device="cuda", dtype=torch.bfloat16)
        _chain(x, r, w, gu_w, down_w, buf)          # compile and tune outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = _chain(x, r, w, gu_w, down_w, buf)
        for _ in range(20):                 # replays back to back: a hazard shows as a changed bit
            g.replay()
        torch.cuda.synchronize()
        outs[pdl] = [t.clone() for t in y]
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
