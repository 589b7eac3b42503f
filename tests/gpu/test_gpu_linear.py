"""On the GPU machine: gemma4opt.linear at decode shapes of the real models equals F.linear to
bf16 rounding, whichever GEMM each shape picked, and more than 32 rows never reach the pick."""
import pytest
import torch
import torch.nn.functional as F

from gemma4opt.ops import linear as linear_op

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 2, 8, 32, 40])
@pytest.mark.parametrize("n,k", [(5376, 8192), (2560, 2048), (16384, 5376)])
def test_linear_op_equals_f_linear(rows, n, k):
    torch.manual_seed(rows + n)
    x = torch.randn(rows, 1, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    got = torch.ops.gemma4opt.linear(x, w)
    want = F.linear(x.float(), w.float())
    assert got.shape == (rows, 1, n) and got.dtype == torch.bfloat16
    # bf16 output rounding (2^-8 relative) on values of size ~1, plus fp32 sum-order differences
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)
    key = (rows, n, k, torch.bfloat16, x.device.index)
    assert (key in linear_op.picks()) == (rows <= linear_op.MAX_ROWS)


@pytest.mark.parametrize("rows", [1, 8, 32, 40])
def test_linear_softcap_op_equals_reference(rows):
    """The lm_head + softcap at a real vocabulary (e4b's hidden size), whichever path the shape picked."""
    from gemma4opt.ops import linear_softcap as ls

    torch.manual_seed(rows)
    n, k = 262144, 2560
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 12 / k ** 0.5).to(torch.bfloat16)    # logits of ~12: the cap bends them
    got = torch.ops.gemma4opt.linear_softcap(x, w, 30.0)
    want = ls.linear_softcap_reference(x.float(), w.float(), 30.0)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=0.1)
    assert ((rows, n, k, torch.bfloat16, 0) in ls.picks()) == (rows <= ls.MAX_ROWS)
    assert not ls.failures()


def test_graph_timing_times_both_paths_on_distinct_weights():
    """The pick's timing (ops/pick.py time_in_graph) runs both paths in a CUDA graph and leaves the
    weight as it was; every call it timed produced F.linear's result."""
    from gemma4opt.kernels.skinny_linear import skinny_linear_triton
    from gemma4opt.ops.pick import time_in_graph

    x = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2048, 2560, device="cuda") / 50).to(torch.bfloat16)
    before = w.clone()
    seen = []

    def triton_fn(wc):
        seen.append(wc.data_ptr())
        return skinny_linear_triton(x, wc)

    t_triton, t_cublas = time_in_graph(triton_fn, lambda wc: F.linear(x, wc), w)
    assert 0 < t_triton < float("inf") and 0 < t_cublas < float("inf")
    assert torch.equal(w, before) and len(set(seen)) > 1       # distinct copies, the weight untouched


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("i,h", [(10240, 2560), (2112, 2816)])      # e4b's and the 26b-a4b's dense MLP
def test_gate_up_gelu_op_equals_hf_math(rows, i, h):
    """The MLP's gate/up + gelu·mul op at real dimensions, whichever path the shape picked (one row
    is timed and picked; more rows run the GEMM then the gelu·mul kernel)."""
    from gemma4opt.ops import gate_up_gelu as gug

    torch.manual_seed(i + rows)
    x = torch.randn(rows, 1, h, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * i, h, device="cuda") / h ** 0.5).to(torch.bfloat16)
    got = torch.ops.gemma4opt.gate_up_gelu(x, w)
    y = F.linear(x.float(), w.float())
    want = F.gelu(y[..., :i], approximate="tanh") * y[..., i:]
    assert got.shape == (rows, 1, i) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert ((rows, 2 * i, h, torch.bfloat16, 0) in gug.picks()) == (rows == 1)
    assert not gug.failures()


@pytest.mark.parametrize("rows", [1, 4, 40])
@pytest.mark.parametrize("n,k", [(2560, 256), (1536, 256)])     # e4b's and e2b's PLE projection
def test_gelu_linear_op_equals_the_two_ops(rows, n, k):
    """The PLE gelu·mul + projection op at real dimensions, whichever path the shape picked: the
    fused GEMM's input is the gelu·mul kernel's bits (the skinny GEMM of them, same tile, equal);
    more than 32 rows never reach the pick."""
    from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton
    from gemma4opt.kernels.skinny_linear import skinny_linear_triton
    from gemma4opt.ops import gelu_linear as gl

    torch.manual_seed(n + rows)
    gate = torch.randn(rows, 1, k, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(rows, 1, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    got = torch.ops.gemma4opt.gelu_linear(gate, up, w)
    act = gelu_tanh_mul_triton(gate, up)
    assert got.shape == (rows, 1, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(act.float(), w.float()), rtol=2e-2, atol=2e-2)
    if rows <= 32:
        assert torch.equal(skinny_linear_triton(gate, w, up=up), skinny_linear_triton(act, w))
    assert ((rows, n, k, torch.bfloat16, 0) in gl.picks()) == (rows <= 32)
    assert not gl.failures()


@pytest.mark.parametrize("rows", [1, 2, 40])
@pytest.mark.parametrize("i,h", [(10240, 2560), (2112, 2816)])      # e4b's and the 26b-a4b's dense MLP
def test_gate_up_gelu_linear_op_equals_hf_math(rows, i, h):
    """A dense MLP as one op at real dimensions, whichever paths its picks took: gate_up_gelu's fused
    GEMV then down, or the gate/up GEMM then down with the gelu·mul made inside it."""
    from gemma4opt.ops import gelu_linear as gl

    torch.manual_seed(i + rows)
    x = torch.randn(rows, 1, h, device="cuda", dtype=torch.bfloat16)
    w_gu = (torch.randn(2 * i, h, device="cuda") / h ** 0.5).to(torch.bfloat16)
    w_d = (torch.randn(h, i, device="cuda") / i ** 0.5).to(torch.bfloat16)
    got = torch.ops.gemma4opt.gate_up_gelu_linear(x, w_gu, w_d)
    y = F.linear(x.float(), w_gu.float()).to(torch.bfloat16)
    act = F.gelu(y[..., :i], approximate="tanh") * y[..., i:]
    want = F.linear(act.float(), w_d.float())
    assert got.shape == (rows, 1, h) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)
    assert not gl.failures()


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("n,k", [(2560, 10240), (5376, 21504)])     # the e4b's and the 31b's MLP down
def test_one_row_split_k_tiles_compiled(split, gelu, n, k):
    """The split-K tiles offered at one row, compiled, at the shapes they are offered for."""
    from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton
    from gemma4opt.kernels.skinny_linear import skinny_linear_triton

    torch.manual_seed(split + n)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) if gelu else None
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    for bk in (512, 1024):
        got = skinny_linear_triton(x, w, dict(BLOCK_N=4, BLOCK_K=bk, SPLIT_K=split), up=up)
        act = gelu_tanh_mul_triton(x, up) if gelu else x
        torch.testing.assert_close(got.float(), F.linear(act.float(), w.float()), rtol=1e-2, atol=2e-2)
