import pytest
import torch

from gemma4opt.kernels.kv_append import kv_append_triton
from gemma4opt.ops.kv_append import kv_append_rows_reference
from tests.kernels.conftest import DEVICE, DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,heads,D,ps", [(1, 1, 1, 24, 4), (3, 5, 2, 40, 3), (2, 7, 3, 64, 16)])
def test_matches_reference_from_hf_transposed_views(dtype, B, T, heads, D, ps):
    g = torch.Generator().manual_seed(B * T + D)
    # HF hands attention [B, heads, T, D]; the op gets its [B, T, heads, D] transpose (strided).
    k = torch.randn(B, heads, T, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    v = torch.randn(B, heads, T, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    pages = B * T // ps + 3
    n = max(1, B * T - 3)                                    # some rows are left padding: skipped
    token_index = torch.randperm(B * T, generator=g)[:n].sort().values.to(torch.int32).to(DEVICE)
    slots = torch.randperm(pages * ps, generator=g)[:n].to(DEVICE)    # int64, as staged
    want = torch.randn(pages, 2, ps, heads, D, generator=g).to(dtype).to(DEVICE)
    got = want.clone()
    kv_append_rows_reference(want, k, v, slots, token_index)
    kv_append_triton(got, k, v, slots, token_index)
    assert torch.equal(got, want)                           # a copy: bit-exact, untouched slots too
