"""The dense MLP's gate/up GEMV with gelu·mul in its epilogue against HF's math (F.linear, then
gelu_tanh(gate) * up), odd widths, strided x, the merged weight as a slice of a bigger buffer."""
import pytest
import torch
import torch.nn.functional as F

from gemma4opt.kernels.gate_up_gelu import MAX_ROWS, gate_up_gelu_fp8_triton, gate_up_gelu_triton
from tests.kernels.conftest import DEVICE, DTYPES, close


def _hf(x, w):
    y = F.linear(x, w)
    i = w.shape[0] // 2
    return F.gelu(y[..., :i], approximate="tanh") * y[..., i:]


def _case(I, H, dtype, seed):
    torch.manual_seed(seed)
    x = torch.randn(1, 1, H).to(dtype).to(DEVICE)
    w = (torch.randn(2 * I, H) / H ** 0.5).to(dtype).to(DEVICE)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("I,H", [(24, 40), (17, 33), (9, 70), (40, 19)])
def test_matches_hf(dtype, I, H):
    x, w = _case(I, H, dtype, seed=I * H)
    got = gate_up_gelu_triton(x, w, launch=dict(gu_n=8, gu_k=16))
    assert got.shape == (1, 1, I) and got.dtype == dtype
    close(got, _hf(x, w), dtype)


def test_strided_x_and_weight_slice():
    x, w = _case(12, 20, torch.float32, seed=3)
    wide = torch.randn(1, 1, 50, device=DEVICE)
    wide[..., 7:27] = x
    big = torch.randn(30, 20, device=DEVICE)
    big[3:27] = w
    close(gate_up_gelu_triton(wide[..., 7:27], big[3:27], launch=dict(gu_n=4, gu_k=8)), _hf(x, w), torch.float32)


def test_refuses_more_rows_and_odd_weights():
    x, w = _case(8, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="at most"):
        gate_up_gelu_triton(x.expand(MAX_ROWS + 1, 1, 16), w)
    with pytest.raises(ValueError, match=r"\[2I, 16\]"):
        gate_up_gelu_triton(x, w[:15])


# With e4m3 weights (quantization="fp8"): the fp8 row its norm quantized against the op it replaces,
# gemma4opt.fp8_linear's reference (dequantize, multiply in fp32, round to the dtype) then gelu·mul.

def _fp8_case(I, H, dtype, seed):
    from gemma4opt.ops.fp8 import quantize_rows_reference, quantize_weight_reference

    x, w = _case(I, H, torch.float32, seed)
    xq, xs = quantize_rows_reference(x * 3)
    wq, ws = quantize_weight_reference(w)
    return xq, xs, wq, ws


def _fp8_want(xq, xs, wq, ws, dtype):
    from gemma4opt.ops.fp8 import fp8_linear_reference
    from gemma4opt.ops.gelu_tanh_mul import gelu_tanh_mul_reference

    y = fp8_linear_reference(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), dtype)
    i = wq.shape[0] // 2
    return gelu_tanh_mul_reference(y[..., :i], y[..., i:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("I,H", [(24, 40), (17, 33), (9, 70), (40, 19)])
def test_fp8_weights_match_the_fp8_gemm_then_gelu_mul(dtype, I, H):
    """Odd widths, H not a multiple of the K tile; each row's sum times the row's and the channel's
    scales (fp32, where the reference scales each product: a rounding of the 16-bit output apart)."""
    xq, xs, wq, ws = _fp8_case(I, H, dtype, seed=I + H)
    got = gate_up_gelu_fp8_triton(xq, xs, wq, ws, dtype, launch=dict(gu_n=8, gu_k=16))
    assert got.shape == (1, 1, I) and got.dtype == dtype
    close(got.cpu(), _fp8_want(xq, xs, wq, ws, dtype), dtype)


def test_fp8_weights_scale_gate_and_up_rows_apart():
    """Gate and up rows with scales far apart (the up half x 64): each half is scaled by its own rows'
    scales, not the other half's."""
    xq, xs, wq, ws = _fp8_case(12, 48, torch.bfloat16, seed=5)
    ws = ws.clone()
    ws[12:] *= 64
    got = gate_up_gelu_fp8_triton(xq, xs, wq, ws, torch.bfloat16, launch=dict(gu_n=4, gu_k=16))
    close(got.cpu(), _fp8_want(xq, xs, wq, ws, torch.bfloat16), torch.bfloat16)


def test_fp8_refuses_mismatched_scales_and_dtypes():
    xq, xs, wq, ws = _fp8_case(8, 16, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="scales of 1 rows and 15 channels"):
        gate_up_gelu_fp8_triton(xq, xs, wq, ws[:15], torch.bfloat16)
    with pytest.raises(ValueError, match="output dtype torch.float8_e4m3fn"):
        gate_up_gelu_fp8_triton(xq, xs, wq, ws, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="at most"):
        gate_up_gelu_fp8_triton(xq.expand(MAX_ROWS + 1, 1, 16), xs.expand(MAX_ROWS + 1, 1), wq, ws, torch.bfloat16)


def test_fp8_autotuned_launch_binds_every_parameter_and_returns_the_chosen_tiles_maxima(monkeypatch):
    """Compiled, the fp8 GEMV's tile is autotuned (the launch and its timing replaced here: no GPU): every
    candidate binds each kernel parameter, and the amaxes returned are those of the chosen tile's programs."""
    import triton

    from gemma4opt.kernels import gate_up_gelu as k
    from tests.kernels.conftest import record_tuned_launches

    launches = record_tuned_launches(monkeypatch, k, k._tuned_fp8)
    xq, xs, wq, ws = _fp8_case(40, 64, torch.bfloat16, seed=2)
    act, parts = gate_up_gelu_fp8_triton(xq, xs, wq, ws, torch.bfloat16, amax=True)
    assert len(launches) == len(k._FP8_TILES) + 1 and {b["FP8"] for b in launches} == {True}
    assert act.shape == (1, 1, 40) and parts.shape == (1, triton.cdiv(40, k._tuned_fp8.best_config.kwargs["BLOCK_N"]))
