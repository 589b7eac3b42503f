"""The dense MLP's gate/up GEMV with gelu·mul in its epilogue against HF's math (F.linear, then
gelu_tanh(gate) * up), odd widths, strided x, the merged weight as a slice of a bigger buffer."""
import pytest
import torch
import torch.nn.functional as F

from gemma4opt.kernels.gate_up_gelu import MAX_ROWS, gate_up_gelu_triton
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
