"""kernels/widen_e4m3.py against torch's table[index].to(dtype) (exact: e4m3 widens without rounding)."""
import pytest
import torch

from gemma4opt.kernels.widen_e4m3 import widen_e4m3_triton

from tests.kernels.conftest import DEVICE


@pytest.mark.parametrize("shape,index", [((5, 3, 7), [4, 0, 4, 2]), ((3, 33, 129), [2, 1]), ((2, 1, 1), [1])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_widen_matches_index_then_cast(shape, index, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    bits = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C       # no NaN bytes: NaN != NaN would fail an exact compare
    table = bits.view(torch.float8_e4m3fn).to(DEVICE)
    idx = torch.tensor(index, device=DEVICE)
    got = widen_e4m3_triton(table, idx, dtype)
    want = table[idx].to(dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_widen_refuses_other_tables():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        widen_e4m3_triton(torch.zeros(2, 4, device=DEVICE), torch.tensor([0], device=DEVICE), torch.bfloat16)
    t = torch.zeros(4, 2, dtype=torch.float8_e4m3fn, device=DEVICE).t()
    with pytest.raises(ValueError, match="contiguous"):
        widen_e4m3_triton(t, torch.tensor([0], device=DEVICE), torch.bfloat16)
