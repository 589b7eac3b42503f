import pytest
import torch

from gemma4opt.kernels.qkv_norm_rope_append import qkv_norm_rope_append_triton
from gemma4opt.ops.qkv_norm_rope_append import qkv_norm_rope_append_reference
from tests.kernels.conftest import DEVICE, DTYPES, TOL, close
from tests.kernels.test_rms_norm_rope_kernel import _cos_sin


def _case(dtype, B, S, HQ, HK, D, ps, k_eq_v=False, padded=0, partial=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    nv = 0 if k_eq_v else HK * D
    # q/k/v are head views of one merged projection output, as the pattern hands them over.
    qkv = (torch.randn(B, S, HQ * D + HK * D + nv, generator=g) * 2).to(dtype).to(DEVICE)
    q = qkv[..., :HQ * D].view(B, S, HQ, D)
    k = qkv[..., HQ * D:HQ * D + HK * D].view(B, S, HK, D)
    v = k if k_eq_v else qkv[..., HQ * D + HK * D:].view(B, S, HK, D)
    wq = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    wk = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    cos, sin = _cos_sin(B, S, D, dtype, partial)
    n = B * S - padded                                     # the first rows are left padding
    token_index = torch.arange(padded, B * S, dtype=torch.int32).to(DEVICE)
    pages = (B * S) // ps + 2
    slots = torch.randperm(pages * ps, generator=g)[:n].to(DEVICE)
    pool = torch.randn(pages, 2, ps, HK, D, generator=g).to(dtype).to(DEVICE)
    return pool, (q, wq, k, wk, v, cos, sin, 1e-6, slots, token_index)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,HQ,HK,D,ps,k_eq_v,padded,partial", [
    (1, 1, 3, 1, 16, 4, False, 0, 1.0),       # one decode token
    (2, 5, 4, 2, 32, 3, False, 3, 0.25),      # prefill with left padding, odd page size
    (3, 1, 6, 3, 24, 16, True, 0, 1.0),       # K = V projection
    (1, 3, 2, 1, 512, 2, True, 1, 0.25),      # full-layer head_dim, proportional RoPE
    (2, 2, 5, 5, 256, 5, False, 0, 1.0),
])
def test_matches_unfused_reference(dtype, B, S, HQ, HK, D, ps, k_eq_v, padded, partial):
    pool, args = _case(dtype, B, S, HQ, HK, D, ps, k_eq_v, padded, partial, seed=B * S + D)
    want_pool, got_pool = pool.clone(), pool.clone()
    want_q = qkv_norm_rope_append_reference(want_pool, *args)
    got_q = qkv_norm_rope_append_triton(got_pool, *args)
    close(got_q, want_q, dtype)
    close(got_pool, want_pool, dtype)
    written = torch.zeros(pool.shape[0] * pool.shape[2], dtype=torch.bool, device=DEVICE)
    written[args[-2]] = True
    untouched = ~written.view(pool.shape[0], pool.shape[2])[:, None].expand(-1, 2, -1)
    assert torch.equal(got_pool[untouched], pool[untouched])     # no slot but the step's is written
    assert not torch.equal(got_pool, pool)


def test_many_tokens_use_head_blocks():
    # Enough rows that programs take several heads each: same results as one head per program.
    pool, args = _case(torch.float32, 4, 80, 8, 4, 16, 16, seed=3)
    want_pool, got_pool = pool.clone(), pool.clone()
    close(qkv_norm_rope_append_triton(got_pool, *args), qkv_norm_rope_append_reference(want_pool, *args),
          torch.float32)
    close(got_pool, want_pool, torch.float32)


@pytest.mark.parametrize("hb,warps", [(2, 2), (8, 4)])
def test_swept_launch_configs_give_the_same_result(hb, warps):
    """bench_kernels --sweep-norm-rope forces other heads-per-program / warps here too: same output."""
    pool, args = _case(torch.float32, 2, 3, 5, 3, 16, 4, padded=1, seed=4)
    want_pool, got_pool = pool.clone(), pool.clone()
    close(qkv_norm_rope_append_triton(got_pool, *args, launch=dict(hb=hb, warps=warps)),
          qkv_norm_rope_append_reference(want_pool, *args), torch.float32)
    close(got_pool, want_pool, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,HQ,HK,D,ps,k_eq_v,padded,partial,scales", [
    (1, 1, 3, 1, 16, 4, False, 0, 1.0, (1.0, 1.0)),
    (2, 5, 4, 2, 32, 3, False, 3, 0.25, (0.37, 2.5)),
    (3, 1, 6, 3, 24, 16, True, 0, 1.0, (1 / 256, 1 / 512)),     # k and v clamp at 448
    (1, 3, 2, 1, 512, 2, True, 1, 0.25, (1.0, 1.0)),
])
def test_fp8_pool(dtype, B, S, HQ, HK, D, ps, k_eq_v, padded, partial, scales):
    """An fp8 pool gets the bytes of quantizing what the kernel writes into a pool of the model's
    dtype (so the quantization itself is exact), which is the reference's up to an e4m3 rounding
    where the norm's last bit differs; q and untouched slots as always."""
    from gemma4opt.ops.kv_append import KV_FP8, kv_quantize

    pool, args = _case(dtype, B, S, HQ, HK, D, ps, k_eq_v, padded, partial, seed=B * S + D + 7)
    kv_scale = torch.tensor(scales, dtype=torch.float32, device=DEVICE)
    fp8 = pool.to(KV_FP8)
    want_pool, got_pool, plain = fp8.clone(), fp8.clone(), pool.clone()
    want_q = qkv_norm_rope_append_reference(want_pool, *args, kv_scale)
    got_q = qkv_norm_rope_append_triton(got_pool, *args, kv_scale=kv_scale)
    qkv_norm_rope_append_triton(plain, *args)
    close(got_q, want_q, dtype)
    slots = args[-2]
    page, off = slots // ps, slots % ps
    for i in (0, 1):
        assert torch.equal(got_pool[page, i, off].view(torch.uint8),
                           kv_quantize(plain[page, i, off], kv_scale[i]).view(torch.uint8))
    # Against the reference: the dtype's tolerance (in the scaled domain) and an e4m3 step (where
    # the two land on either side of a rounding boundary); mostly the same bytes.
    atol = TOL[dtype]["atol"] / min(scales) + 2.0 ** -9
    torch.testing.assert_close(got_pool.float(), want_pool.float(), rtol=0.13, atol=atol)
    assert (got_pool.view(torch.uint8) == want_pool.view(torch.uint8)).float().mean() > 0.9
    written = torch.zeros(pool.shape[0] * pool.shape[2], dtype=torch.bool, device=DEVICE)
    written[slots] = True
    untouched = ~written.view(pool.shape[0], pool.shape[2])[:, None].expand(-1, 2, -1)
    assert torch.equal(got_pool[untouched].view(torch.uint8), fp8[untouched].view(torch.uint8))
    if scales[0] < 0.01:
        assert (got_pool[page, :, off].float().abs() == 448).any()
