"""The fused producer + FP8 quantization kernels (kernels/fp8_quant.py) against their references.

Two comparisons each:
- exact: the unfused Triton producer's output quantized by the reference. The fused kernel
  computes the producer op for op as the unfused kernel does, so it quantizes the same values:
  the same fp8 bytes and the same scales, bit for bit.
- the op's plain-torch reference (the unfused op then quantize_rows_reference). Its producer rounds
  differently in fp32 (RMSNorm: pow(mean + eps, -0.5) against 1 / sqrt(sum / D + eps), and another
  sum order; gelu: torch's tanh against the kernel's exp form), so a value may land an ulp or two
  of x.dtype away (a few fp32 ulps in fp32). Where the two producers agree to two x.dtype ulps
  (or to far below e4m3's smallest step), the fp8 bytes are at most one fp8 ulp apart (such a
  difference, and the scale's below, are far under half an fp8 ulp, 2^-4 relative, so they can
  cross at most one rounding boundary). Where
  they do not (add_rms_norm: residual + norm cancels, and an ulp of the norm is many ulps of the
  small sum), the dequantized values are within fp8 rounding plus the producer tolerance of
  tests/kernels/conftest.py, as the unfused kernels' own tests allow. The scales are within 1e-6
  relative beyond the difference of the two producers' row amax (an amax element an ulp away
  moves the scale by as much).
"""
import pytest
import torch
import triton
import triton.language as tl

from gemma4opt.kernels.add_rms_norm import add_rms_norm_triton
from gemma4opt.kernels.fp8_quant import (add_rms_norm_quant_triton, fp8_quantize, gelu_tanh_mul_quant_triton,
                                         quantize_rows_triton, rms_norm_quant_triton)
from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton
from gemma4opt.kernels.rms_norm import rms_norm_triton
from gemma4opt.ops.add_rms_norm import add_rms_norm_reference
from gemma4opt.ops.fp8 import SCALE_MIN, dequantize_rows_reference, quantize_rows_reference
from gemma4opt.ops.gelu_tanh_mul import gelu_tanh_mul_reference
from gemma4opt.ops.rms_norm import rms_norm_reference
from tests.kernels.conftest import DEVICE, DTYPES, TOL, close

SHAPES = [(1, 40), (3, 200), (17, 40), (2, 3, 72)]


@triton.jit
def _convert_kernel(X, Q, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    tl.store(Q + i, fp8_quantize(tl.load(X + i, mask=m, other=0.0), 1.0), mask=m)


def fp8_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in fp8 ulps: e4m3fn bytes are sign-magnitude, so the magnitude bits count steps."""
    def ordered(q):
        u = q.view(torch.uint8).to(torch.int16)
        mag = u & 0x7F
        return torch.where(u >= 0x80, -mag, mag)
    return (ordered(a) - ordered(b)).abs()


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float8_e4m3fn and got.shape == want.shape
    differ = int((fp8_ulps(got, want) > 0).sum())
    assert differ == 0, f"{differ} bytes differ"


def check(got, got_scale, unfused, reference):
    """got (fp8, scales) against (1) quantize_rows(unfused Triton producer output), exactly, and
    (2) quantize_rows(reference producer output) (module docstring)."""
    assert got_scale.dtype == torch.float32 and got_scale.shape == got.shape[:-1]
    eq, es = quantize_rows_reference(unfused)
    same_bytes(got, eq)
    assert torch.equal(got_scale, es)
    dtype = reference.dtype
    rq, rs = quantize_rows_reference(reference)
    u, r = unfused.float(), reference.float()
    # "agree": two x.dtype ulps, or far below e4m3's smallest step (2^-9 x scale) near zero, where
    # the kernel's exp-form tanh differs from torch's in relative terms (gelu of -5 is ~1e-6).
    near = (u - r).abs() <= 2 * torch.finfo(dtype).eps * r.abs() + 2 ** -12 * rs.unsqueeze(-1)
    assert near.float().mean() >= 0.9, "the producers differ on more than a tenth of the values"
    assert int(fp8_ulps(got, rq)[near].max()) <= 1
    deq = dequantize_rows_reference(got, got_scale)
    fp8_err = 2 ** -4 * r.abs() + 2 ** -10 * got_scale.unsqueeze(-1)
    tol = TOL[dtype]
    assert ((deq - r).abs() <= fp8_err + tol["atol"] + tol["rtol"] * r.abs()).all()
    ga, ra = u.abs().amax(-1), r.abs().amax(-1)
    slack = (ga - ra).abs() / ra.clamp_min(SCALE_MIN)
    assert ((got_scale - rs).abs() / rs <= slack + 1e-6).all()


def _x(shape, dtype, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_quant(dtype, shape, with_weight):
    x = _x(shape, dtype)
    w = (1 + 0.3 * _x(shape[-1:], torch.float32, 1.0, 1)).to(dtype) if with_weight else None
    q, s = rms_norm_quant_triton(x, w, 1e-6)
    assert q.shape == x.shape and s.shape == x.shape[:-1]
    check(q, s, rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_scale", [True, False])
def test_add_rms_norm_quant(dtype, shape, with_scale):
    x, r = _x(shape, dtype, 2.0), _x(shape, dtype, 1.0, 1)
    w1 = (1 + 0.3 * _x(shape[-1:], torch.float32, 1.0, 2)).to(dtype)
    w2 = (1 + 0.3 * _x(shape[-1:], torch.float32, 1.0, 3)).to(dtype)
    scale = torch.tensor([0.7], dtype=dtype, device=DEVICE) if with_scale else None
    s, q, qs = add_rms_norm_quant_triton(x, r, w1, 1e-6, scale, w2, 1e-5)
    us, un = add_rms_norm_triton(x, r, w1, 1e-6, scale, w2, 1e-5)
    rs, rn = add_rms_norm_reference(x, r, w1, 1e-6, scale, w2, 1e-5)
    assert s.dtype == dtype and s.shape == x.shape and q.shape == x.shape and qs.shape == x.shape[:-1]
    assert torch.equal(s, us)           # the residual stream: the unfused kernel's, bit for bit
    close(s, rs, dtype)
    check(q, qs, un, rn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("max_block,split", [(8192, 0), (32, 0), (8192, 16), (8192, 64)])
def test_gelu_tanh_mul_quant(dtype, shape, max_block, split):
    """max_block 32: rows of 40-200 in 2-7 chunks, two passes; split: rows over programs of 16 or 64
    columns (one to 13 per row, the last partly masked), two launches."""
    g, u = _x(shape, dtype), _x(shape, dtype, 1.0, 1)
    q, s = gelu_tanh_mul_quant_triton(g, u, max_block=max_block, split=split)
    assert q.shape == g.shape and s.shape == g.shape[:-1]
    check(q, s, gelu_tanh_mul_triton(g, u), gelu_tanh_mul_reference(g, u))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("max_block", [8192, 32])
def test_quantize_rows_equals_the_reference(dtype, shape, max_block):
    """Quantizing on its own has no producer to round: the bytes and scales equal the reference's."""
    x = _x(shape, dtype)
    q, s = quantize_rows_triton(x, max_block=max_block)
    eq, es = quantize_rows_reference(x)
    same_bytes(q, eq)
    assert torch.equal(s, es)


def test_quantize_rows_reads_strided_rows():
    x = _x((3, 400), torch.bfloat16)[:, 100:300]
    q, s = quantize_rows_triton(x, max_block=64)
    same_bytes(q, quantize_rows_reference(x)[0])


def test_gelu_reads_halves_of_a_merged_gemm_output():
    gu = _x((3, 2 * 200), torch.bfloat16)
    g, u = gu[:, :200], gu[:, 200:]
    assert not g.is_contiguous()
    for split in (0, 64):
        q, s = gelu_tanh_mul_quant_triton(g, u, max_block=64, split=split)
        check(q, s, gelu_tanh_mul_triton(g, u), gelu_tanh_mul_reference(g, u))


def test_few_long_rows_take_the_split_path_by_default():
    """The decode shapes (a few rows of thousands of columns) are spread over programs; the split
    path's bytes equal the one-program path's, on a row whose amax sits in its last program."""
    from gemma4opt.kernels.fp8_quant import _split_columns
    assert _split_columns(1, 21504) == 1024 and _split_columns(32, 21504) == 2048
    assert _split_columns(1, 2048) == 0 and _split_columns(4096, 21504) == 0
    g, u = _x((2, 4100), torch.bfloat16), _x((2, 4100), torch.bfloat16, 1.0, 1)
    g[:, -1] = 8.0
    q, s = gelu_tanh_mul_quant_triton(g, u)
    q1, s1 = gelu_tanh_mul_quant_triton(g, u, split=0)
    same_bytes(q, q1)
    assert torch.equal(s, s1)


def test_zero_rows_quantize_to_zero_with_the_minimum_scale():
    x = _x((3, 40), torch.bfloat16)
    x[1] = 0
    q, s = rms_norm_quant_triton(x, None, 1e-6)
    assert s[1] == SCALE_MIN and (q[1].float() == 0).all() and (q[0].float() != 0).any()
    g = _x((3, 40), torch.float32)
    g[2] = 0
    q, s = gelu_tanh_mul_quant_triton(g, torch.ones_like(g), max_block=16)
    assert s[2] == SCALE_MIN and (q[2].float() == 0).all()
    q2, s2 = gelu_tanh_mul_quant_triton(g, torch.ones_like(g), split=16)
    same_bytes(q2, q)
    assert torch.equal(s2, s)
    check(q, s, gelu_tanh_mul_triton(g, torch.ones_like(g)), gelu_tanh_mul_reference(g, torch.ones_like(g)))


def test_empty_and_mismatched_inputs():
    q, s = rms_norm_quant_triton(torch.empty(0, 40, device=DEVICE), None, 1e-6)
    assert q.shape == (0, 40) and s.shape == (0,)
    with pytest.raises(ValueError, match="differ"):
        gelu_tanh_mul_quant_triton(torch.randn(2, 8, device=DEVICE), torch.randn(1, 8, device=DEVICE))


def test_fp8_conversion_matches_torch_on_every_value_and_tie():
    """fp8_quantize's fp32 -> e4m3 conversion (under the interpreter: the grid rounding that works
    around its converter) equals torch's: every e4m3 value, the ties between neighbours (to even),
    round-ups into the next binade, subnormals, signed zeros."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(500.0)),
                   torch.linspace(-448, 448, 20001), torch.tensor([-0.0, 1e-30, -1e-30, 127.99, -127.99, 460.0])])
    q = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device=DEVICE)
    _convert_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), q, x.numel(), BLOCK=1024)
    same_bytes(q.cpu(), x.clamp(-448, 448).to(torch.float8_e4m3fn))
