"""On the GPU machine: the fp8 GEMMs that make their own input at decode, at the real models' sizes.
quant_fp8_linear (o_proj, the MLP's down: the GEMM quantizes its bf16 input) compiled for sm_90, each
tile kind, against quantize_rows + the fp8 GEMM; the fp8 MLP op (the gate/up GEMV with gelu·mul in its
epilogue, then the quantizing down GEMM) against its reference's ops; the picks each op keeps."""
import pytest
import torch

import gemma4opt.ops  # noqa: F401
from gemma4opt.ops import gelu_linear as mlp_op
from gemma4opt.ops import quant_fp8_linear as quant_op
from gemma4opt.ops.fp8 import fp8_linear_reference, quantize_rows_reference, quantize_weight_reference
from gemma4opt.ops.gelu_linear import fp8_gate_up_gelu_linear_reference
from gemma4opt.ops.state import OpState, active

pytestmark = pytest.mark.gpu


def _weight(n, k, seed=0):
    torch.manual_seed(seed + n + k)
    return quantize_weight_reference((torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16))


def _x(rows, k, seed=1):
    torch.manual_seed(seed + rows + k)
    return (torch.randn(rows, k, device="cuda") * torch.rand(rows, 1, device="cuda") * 4).to(torch.bfloat16)


def _close(got, x, wq, ws):
    xq, xs = quantize_rows_reference(x)
    want = fp8_linear_reference(xq, xs, wq, ws, torch.float32)
    # bf16 output rounding, fp32 sum-order differences and the fp8 MMA's promotion every 32 products
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)


# (N, K): the e4b's o_proj and down, the 31b's o_proj and down, the 26b-a4b's down.
SHAPES = [(2560, 2048), (2560, 10240), (5376, 8192), (5376, 21504), (2816, 2112)]


@pytest.mark.parametrize("rows", [1, 4, 32])
@pytest.mark.parametrize("n,k", SHAPES)
def test_quantizing_gemm_autotuned_equals_quantize_then_gemm(rows, n, k):
    from gemma4opt.kernels.fp8_linear import quant_fp8_linear_triton

    wq, ws = _weight(n, k)
    x = _x(rows, k)
    _close(quant_fp8_linear_triton(x, wq, ws, torch.bfloat16), x, wq, ws)


@pytest.mark.parametrize("config", [dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=2048), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256,
                                    SPLIT_K=4, SWAP=True), dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=2, SWAP=True)])
def test_quantizing_gemm_each_tile_kind(config):
    """Row sums, one row padded through the fp8 wgmma split in 4, 8 rows split in 2 (the split sum reads
    the scales the kernel wrote)."""
    from gemma4opt.kernels.fp8_linear import quant_fp8_linear_triton

    wq, ws = _weight(2560, 10240)
    x = _x(1 if config.get("BLOCK_M") else 8, 10240)
    _close(quant_fp8_linear_triton(x, wq, ws, torch.bfloat16, config), x, wq, ws)


def test_quant_fp8_linear_op_picks_per_shape_and_matches():
    state = OpState()
    wq, ws = _weight(2560, 2048)
    with active(state):
        for rows in (1, 8, 40):
            x = _x(rows, 2048)
            _close(torch.ops.gemma4opt.quant_fp8_linear(x, wq, ws, torch.bfloat16), x, wq, ws)
    keys = set(quant_op.picks(state)) | set(quant_op.failures(state))
    assert {k[0] for k in keys} == {1, 8}, keys      # 40 rows: quantize_rows + _scaled_mm, never timed
    assert not quant_op.failures(state), quant_op.failures(state)
    print("quant_fp8_linear picks:", quant_op.picks(state))


@pytest.mark.parametrize("two_i,h", [(20480, 2560), (12288, 1536), (43008, 5376)])
def test_fp8_mlp_op_equals_its_reference(two_i, h):
    """The e4b's, the e2b's and the 31b's dense MLP at one row: the fused path (gate/up GEMV writing its
    programs' amaxes, the down GEMM quantizing with their max) and the op (its pick) against the
    reference's four ops, on the same quantized row."""
    wgu, sgu = _weight(two_i, h, seed=3)
    wd, sd = _weight(h, two_i // 2, seed=4)
    xq, xs = quantize_rows_reference(_x(1, h))
    state = OpState()
    with active(state):
        op = torch.ops.gemma4opt.fp8_gate_up_gelu_linear(xq, xs, wgu, sgu, wd, sd, torch.bfloat16)
        fused = mlp_op.fp8_mlp_fused(xq, xs, wgu, sgu, wd, sd, torch.bfloat16)
        want = fp8_gate_up_gelu_linear_reference(xq, xs, wgu, sgu, wd, sd, torch.bfloat16)
    # the activation's bf16 rounding may differ by one ulp where the gate/up sums add in another order,
    # which moves a quantized byte now and then: relative error of the whole output
    for got in (op, fused):
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, float(err)
    assert not mlp_op.fp8_failures(state), mlp_op.fp8_failures(state)
    print(f"fp8 MLP {two_i}x{h}: fused {mlp_op.fp8_picks(state)}, err {err:.2e}")
