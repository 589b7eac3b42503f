"""ops/fp8_block.py's references (the semantics of transformers' FineGrainedFP8 linears) against an
independent per-tile loop over weights made by transformers' own quantizer, and the op's CPU path
and backward."""
import math

import pytest
import torch

import gemma4opt.ops  # noqa: F401
from gemma4opt.ops.fp8 import FP8_DTYPE, SCALE_MIN, quantize_rows_reference
from gemma4opt.ops.fp8_block import (dequantize_blocks_reference, fp8_block_linear_reference,
                                     quantize_blocks_reference, quantize_groups_reference)
from gemma4opt.presets import finegrained_fp8_
from tests.models import tiny


def _hf_linear(block=(32, 32)):
    """A q_proj as transformers' FineGrainedFP8 loading leaves it (its Fp8Quantize made the bytes)."""
    model = finegrained_fp8_(tiny(), block)
    return model.model.layers[0].self_attn.q_proj


def _per_tile(x, wq, w_scale_inv, bn, bk):
    """The FineGrainedFP8 kernel's loop: per group of bk, each token's scale amax / 448, its e4m3
    bytes, and per (bn x bk) weight tile the product times both scales, summed in fp32."""
    M, K = x.shape
    N = wq.shape[0]
    out = torch.zeros(M, N, dtype=torch.float64)
    for g in range(math.ceil(K / bk)):
        xg = x[:, g * bk:(g + 1) * bk].float()
        s = xg.abs().amax(1, keepdim=True) / 448.0
        q = (xg / s).to(FP8_DTYPE).double()
        for nb in range(math.ceil(N / bn)):
            w = wq[nb * bn:(nb + 1) * bn, g * bk:(g + 1) * bk].double()
            out[:, nb * bn:(nb + 1) * bn] += (q @ w.t()) * s.double() * float(w_scale_inv[nb, g])
    return out


@pytest.mark.parametrize("block", [(32, 32), (16, 32), (64, 16)])
def test_reference_equals_the_per_tile_loop_on_transformers_weights(block):
    lin = _hf_linear(block)
    assert lin.weight.dtype == FP8_DTYPE and lin.weight_scale_inv.shape == (64 // block[0], 64 // block[1])
    x = torch.randn(5, 64) * torch.linspace(0.1, 4, 64)
    got = fp8_block_linear_reference(x, lin.weight, lin.weight_scale_inv, *block)
    torch.testing.assert_close(got.double(), _per_tile(x, lin.weight, lin.weight_scale_inv, *block),
                               rtol=1e-5, atol=1e-5)


def test_groups_quantize_as_rows_do_and_zero_groups_to_zeros():
    """One group as long as the row is ops/fp8.py's per-token quantization, byte for byte; a group
    of zeros takes the minimum scale and quantizes to zeros (the kernel hub's divides 0 by 0)."""
    x = torch.randn(3, 40)
    q, s = quantize_groups_reference(x, 64)
    q_row, s_row = quantize_rows_reference(x)
    assert torch.equal(q.view(torch.uint8), q_row.view(torch.uint8)) and torch.equal(s[:, 0], s_row)
    x[1, 8:16] = 0
    q, s = quantize_groups_reference(x, 8)
    assert q.shape == (3, 40) and s.shape == (3, 5)
    assert s[1, 1] == SCALE_MIN and (q[1, 8:16].float() == 0).all()
    xd = dequantize_blocks_reference(q.unsqueeze(-2), s.unsqueeze(-2), 1, 8).squeeze(-2)
    torch.testing.assert_close(xd, x, rtol=2 ** -3, atol=0)        # e4m3: 3 mantissa bits


def test_block_weights_round_trip_with_partial_edge_tiles():
    w = torch.randn(50, 70)
    q, s = quantize_blocks_reference(w, 16, 32)
    assert q.shape == (50, 70) and s.shape == (4, 3)
    torch.testing.assert_close(dequantize_blocks_reference(q, s, 16, 32), w, rtol=2 ** -3, atol=0)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_blocks_reference(w[0], 16, 32)


def test_op_cpu_path_and_input_gradient():
    """The CPU op is the reference; its backward takes the input's gradient through the dequantized
    weight (as transformers' FP8Linear does for adapters) and gives none to the fp8 weight."""
    lin = _hf_linear()
    x = torch.randn(2, 3, 64, requires_grad=True)
    y = torch.ops.gemma4opt.fp8_block_linear(x, lin.weight, lin.weight_scale_inv, 32, 32)
    assert torch.equal(y, fp8_block_linear_reference(x.detach(), lin.weight, lin.weight_scale_inv, 32, 32))
    g = torch.randn_like(y)
    y.backward(g)
    w = dequantize_blocks_reference(lin.weight, lin.weight_scale_inv, 32, 32)
    torch.testing.assert_close(x.grad, g @ w)
