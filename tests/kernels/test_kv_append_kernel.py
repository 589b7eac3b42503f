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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,heads,D,ps", [(1, 1, 1, 24, 4), (3, 5, 2, 40, 3), (2, 7, 3, 64, 16)])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5), (1 / 128, 1 / 64)])
def test_fp8_pool_bytes_equal_reference(dtype, B, T, heads, D, ps, scales):
    """Into an fp8 pool: clamp(x / scale, +-448) as e4m3, the same bytes as the reference, with
    values on e4m3 ties and carries (the interpreter's conversion is wrong on those: fp8_quantize
    rounds to the grid first), and scales small enough that some values clamp at 448."""
    from gemma4opt.ops.kv_append import KV_FP8

    g = torch.Generator().manual_seed(B * T + D + 1)
    k = (torch.randn(B, heads, T, D, generator=g) * 3).to(dtype)
    # Ties (336: between 320 and 352), carries (127.99 -> 128) and tiny values, scaled as stored.
    k.view(-1)[:6] = torch.tensor([336.0, -336.0, 127.99, 0.3, 2.0 ** -10, 17.0]).to(dtype) * scales[0]
    k = k.to(DEVICE).transpose(1, 2)
    v = (torch.randn(B, heads, T, D, generator=g) * 3).to(dtype).to(DEVICE).transpose(1, 2)
    pages = B * T // ps + 3
    n = max(1, B * T - 3)
    token_index = torch.randperm(B * T, generator=g)[:n].sort().values.to(torch.int32).to(DEVICE)
    slots = torch.randperm(pages * ps, generator=g)[:n].to(DEVICE)
    kv_scale = torch.tensor(scales, dtype=torch.float32, device=DEVICE)
    want = torch.randn(pages, 2, ps, heads, D, generator=g).to(KV_FP8).to(DEVICE)
    got = want.clone()
    kv_append_rows_reference(want, k, v, slots, token_index, kv_scale)
    kv_append_triton(got, k, v, slots, token_index, kv_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if scales[0] < 0.01:
        assert (want.float().abs() == 448).any()      # the clamp was exercised


def test_fp8_pool_without_scales_is_refused():
    from gemma4opt.ops.kv_append import KV_FP8

    kv = torch.zeros(2, 2, 4, 1, 16, dtype=KV_FP8)
    k = torch.zeros(1, 1, 1, 16)
    with pytest.raises(ValueError, match="needs kv_scale"):
        torch.ops.gemma4opt.kv_append(kv, k, k, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.int32))
