"""ops/fp8.py's quantization references (vLLM's semantics) and the fp8 ops' registrations: fake
shapes and torch.library.opcheck of each op's CPU path (the reference)."""
import pytest
import torch

import gemma4opt.ops  # noqa: F401  (registers the ops)
from gemma4opt.ops.fp8 import (FP8_DTYPE, FP8_MAX, SCALE_MIN, dequantize_rows_reference, fp8_linear_reference,
                               quantize_rows_reference, quantize_weight_reference)
from tests.kernels.conftest import DEVICE, DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 40), (3, 200), (17, 72), (2, 3, 40)])
def test_round_trip_error_bound(dtype, shape):
    x = (torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 10).to(dtype)
    q, s = quantize_rows_reference(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    err = (dequantize_rows_reference(q, s) - xf).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value for normals; below 2^-6 (in
    # scaled units) subnormals step by 2^-9, half of which is 2^-10 x scale.
    assert (err <= 2 ** -4 * xf.abs() + 2 ** -10 * s.unsqueeze(-1)).all()
    assert (err <= 2 ** -4 * amax).all()
    # The row's amax maps to +-448 and back to itself (to fp32 rounding of amax / 448 * 448).
    assert (q.float().abs().amax(-1) == FP8_MAX).all()
    torch.testing.assert_close(s * FP8_MAX, amax.squeeze(-1), rtol=2e-7, atol=0)


def test_all_zero_row_and_tiny_rows():
    x = torch.zeros(3, 40)
    x[1, 5] = 1e-30                 # amax / 448 below SCALE_MIN: clamped, quantizes to zero
    x[2] = torch.randn(40)
    q, s = quantize_rows_reference(x)
    assert s[0] == SCALE_MIN and s[1] == SCALE_MIN and s[2] > SCALE_MIN
    assert (q[:2].float() == 0).all() and torch.isfinite(q.float()).all()
    assert (dequantize_rows_reference(q, s)[0] == 0).all()


def test_values_at_the_edges_do_not_overflow():
    x = torch.tensor([[448.0, -448.0, 1.0, 0.0], [3e38, -3e38, 1.0, 0.0], [1e-3, -2e-3, 0.0, 5e-4]])
    q, s = quantize_rows_reference(x)
    assert torch.isfinite(q.float()).all() and (q.float().abs().amax(-1) == FP8_MAX).all()


def test_weight_scales_are_per_output_channel():
    w = torch.randn(40, 72) * torch.linspace(0.01, 5, 40)[:, None]
    w[7] = 0
    q, s = quantize_weight_reference(w)
    assert q.shape == (40, 72) and s.shape == (40,) and s[7] == SCALE_MIN
    torch.testing.assert_close(s, (w.abs().amax(1) / FP8_MAX).clamp_min(SCALE_MIN), rtol=0, atol=0)
    with pytest.raises(ValueError, match="N, K"):
        quantize_weight_reference(torch.randn(2, 3, 4))


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_linear_reference_is_the_dequantized_product(out_dtype):
    x, w = torch.randn(3, 2, 72), torch.randn(40, 72) / 72 ** 0.5
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight_reference(w)
    got = fp8_linear_reference(xq, xs, wq, ws, out_dtype)
    assert got.shape == (3, 2, 40) and got.dtype == out_dtype
    want = (xq.float() * xs[..., None]) @ (wq.float() * ws[:, None]).T
    torch.testing.assert_close(got, want.to(out_dtype), rtol=0, atol=0)
    # and an fp8 approximation of the unquantized product (2^-4 relative per operand, K = 72 terms)
    torch.testing.assert_close(got.float(), x @ w.T, rtol=0.15, atol=0.15)


def test_kernel_constants_match_the_reference():
    pytest.importorskip("triton")
    from gemma4opt.kernels import fp8_quant

    assert fp8_quant.FP8_MAX == FP8_MAX == torch.finfo(torch.float8_e4m3fn).max
    assert fp8_quant.SCALE_MIN == SCALE_MIN


def _samples():
    x = torch.randn(3, 40)
    r = torch.randn(3, 40)
    w = 1 + 0.3 * torch.randn(40)
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight_reference(torch.randn(24, 40))
    ops = torch.ops.gemma4opt
    return [
        ("rms_norm_quant", ops.rms_norm_quant.default, (x, w, 1e-6)),
        ("rms_norm_quant no weight", ops.rms_norm_quant.default, (x, None, 1e-6)),
        ("add_rms_norm_quant", ops.add_rms_norm_quant.default,
         (x, r, w, 1e-6, torch.tensor([0.5]), w.flip(0), 1e-5)),
        ("add_rms_norm_quant no scale", ops.add_rms_norm_quant.default, (x, r, w, 1e-6, None, w, 1e-6)),
        ("gelu_tanh_mul_quant", ops.gelu_tanh_mul_quant.default, (x, r)),
        ("quantize_rows", ops.quantize_rows.default, (x,)),
        ("fp8_linear bf16", ops.fp8_linear.default, (xq, xs, wq, ws, torch.bfloat16)),
        ("fp8_linear fp32", ops.fp8_linear.default, (xq, xs, wq, ws, torch.float32)),
    ]


@pytest.mark.parametrize("name,op,args", _samples(), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, op, args):
    """Schema, fake impl against the real one, autograd registration, AOT dispatch (the CPU path)."""
    if any(isinstance(a, torch.Tensor) and a.dtype == FP8_DTYPE for a in args):
        # test_schema's mutation check compares each input before and after with torch.allclose,
        # which has no CPU kernel for float8_e4m3fn (torch 2.13: "mul_cpu_reduced_float" not
        # implemented): the other three checks run, and the mutation check is done by hand below.
        before = [a.view(torch.uint8).clone() if a.dtype == FP8_DTYPE else a.clone()
                  for a in args if isinstance(a, torch.Tensor)]
        torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                    "test_aot_dispatch_dynamic"))
        out = op(*args)
        after = [a.view(torch.uint8) if a.dtype == FP8_DTYPE else a for a in args if isinstance(a, torch.Tensor)]
        assert all(torch.equal(b, a) for b, a in zip(before, after))
        assert all(out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
                   for a in args if isinstance(a, torch.Tensor))
    else:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("name,op,args", _samples(), ids=lambda v: v if isinstance(v, str) else "")
def test_fake_matches_cpu_path(name, op, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    if isinstance(real, torch.Tensor):
        real, fake = (real,), (fake,)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


def test_row_scale_is_the_correctly_rounded_division_on_every_device():
    # CUDA divides by a Python float as a multiply by its reciprocal, an ulp off in many rows; the
    # kernels divide with div_rn, so the reference must too. amax / 448 in fp64 rounded to fp32 is
    # the correctly rounded fp32 quotient.
    x = torch.randn(4096, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 3
    _, s = quantize_rows_reference(x)
    want = (x.abs().amax(-1).double() / FP8_MAX).float().clamp_min(SCALE_MIN)
    assert torch.equal(s, want)
