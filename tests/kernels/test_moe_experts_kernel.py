import pytest
import torch

from gemma4opt.kernels.moe_experts import MAX_PAIRS, moe_experts_triton
from gemma4opt.ops.moe_experts import moe_experts_reference
from tests.kernels.conftest import DEVICE, DTYPES, close


def _case(T, k, E, I, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype).to(DEVICE)
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype).to(DEVICE)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(DEVICE)      # fp32, as HF's router gives
    return x, idx, w, gate_up, down


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,k,E,I,H", [(1, 2, 5, 24, 40), (3, 4, 6, 17, 33), (8, 8, 9, 12, 70), (2, 3, 7, 20, 36),
                                       (5, 6, 8, 9, 19)])
def test_matches_reference(dtype, T, k, E, I, H):
    """Odd widths (not multiples of the tiles), several tokens sharing experts, fp32 routing weights,
    top-k not a power of two (the down kernel pads the token's experts to one)."""
    launch = dict(gu_n=8, gu_k=16, dn_n=4, dn_k=16)
    x, idx, w, gate_up, down = _case(T, k, E, I, H, dtype, seed=T * 100 + k)
    close(moe_experts_triton(x, idx, w, gate_up, down, launch=launch),
          moe_experts_reference(x, idx, w, gate_up, down), dtype)


def test_strided_token_rows_and_expert_slices():
    """x as a column slice of a wider buffer; the experts' stacked weights as slices of bigger stacks."""
    launch = dict(gu_n=4, gu_k=8, dn_n=2, dn_k=8, dn_warps=2)
    x, idx, w, gate_up, down = _case(2, 2, 4, 8, 16, torch.float32, seed=7)
    wide = torch.randn(2, 40, device=DEVICE)
    wide[:, 5:21] = x
    big_gu = torch.randn(6, 16, 16, device=DEVICE)
    big_gu[1:5] = gate_up
    close(moe_experts_triton(wide[:, 5:21], idx, w, big_gu[1:5], down, launch=launch),
          moe_experts_reference(x, idx, w, gate_up, down), torch.float32)


def test_refuses_prefill_sizes_and_mismatched_weights():
    x, idx, w, gate_up, down = _case(1, 2, 4, 8, 16, torch.float32, seed=1)
    many = MAX_PAIRS // 2 + 1
    with pytest.raises(ValueError, match="at most 64"):
        moe_experts_triton(x.expand(many, -1), idx.expand(many, -1), w.expand(many, -1), gate_up, down,
                           grouped=False)
    with pytest.raises(ValueError, match="do not match"):
        moe_experts_triton(x, idx, w, gate_up, down.transpose(1, 2))


def test_no_tokens():
    x, idx, w, gate_up, down = _case(1, 2, 4, 8, 16, torch.float32, seed=2)
    assert moe_experts_triton(x[:0], idx[:0], w[:0], gate_up, down).shape == (0, 16)


def test_k_tiles_pad_little():
    from gemma4opt.kernels.moe_experts import _block_k

    assert _block_k(2816, 512) == 512 and _block_k(704, 512) == 256 and _block_k(40, 16) == 16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,k,E,I,H", [(1, 2, 5, 24, 40), (3, 3, 6, 17, 33), (8, 8, 9, 12, 70)])
def test_fp8_experts_match_reference(dtype, T, k, E, I, H):
    """e4m3 experts with per-(expert, row) scales (quantization="fp8"): the scales in both kernels'
    epilogues, odd widths, top-k not a power of two."""
    from gemma4opt.ops.fp8 import quantize_rows_reference
    from gemma4opt.ops.moe_experts_fp8 import moe_experts_fp8_reference

    x, idx, w, gate_up, down = _case(T, k, E, I, H, dtype, seed=T * 10 + k)
    gu_q, gu_s = quantize_rows_reference(gate_up)
    d_q, d_s = quantize_rows_reference(down)
    launch = dict(gu_n=8, gu_k=16, dn_n=4, dn_k=16)
    got = moe_experts_triton(x, idx, w, gu_q, d_q, launch=launch, gate_up_scale=gu_s, down_scale=d_s)
    close(got, moe_experts_fp8_reference(x, idx, w, gu_q, gu_s, d_q, d_s), dtype)


def test_fp8_reference_is_hfs_math_on_the_dequantized_weights():
    """The op's reference against the pair-by-pair bf16 oracle run on the dequantized weights."""
    from gemma4opt.ops.fp8 import quantize_rows_reference
    from gemma4opt.ops.moe_experts_fp8 import moe_experts_fp8_reference

    x, idx, w, gate_up, down = _case(5, 3, 6, 20, 36, torch.float32, seed=11)
    gu_q, gu_s = quantize_rows_reference(gate_up)
    d_q, d_s = quantize_rows_reference(down)
    deq_gu, deq_d = gu_q.float() * gu_s[..., None], d_q.float() * d_s[..., None]
    close(moe_experts_fp8_reference(x, idx, w, gu_q, gu_s, d_q, d_s),
          moe_experts_reference(x, idx, w, deq_gu, deq_d), torch.float32)


@pytest.mark.parametrize("T,k,E,I,H", [(1, 2, 5, 24, 40), (37, 3, 6, 17, 33), (60, 8, 40, 12, 70)])
def test_fp8_grouped_prefill_path_matches_reference(T, k, E, I, H):
    """The prefill path (plain torch, CUDA's beyond the decode kernels' pairs) against the reference:
    experts with no tokens, uneven counts, more experts than one dequantized group (40 > 16)."""
    from gemma4opt.ops.fp8 import quantize_rows_reference
    from gemma4opt.ops.moe_experts_fp8 import moe_experts_fp8_grouped, moe_experts_fp8_reference

    for dtype in DTYPES:
        x, idx, w, gate_up, down = _case(T, k, E, I, H, dtype, seed=T + k + E)
        gu_q, gu_s = quantize_rows_reference(gate_up)
        d_q, d_s = quantize_rows_reference(down)
        close(moe_experts_fp8_grouped(x, idx, w, gu_q, gu_s, d_q, d_s),
              moe_experts_fp8_reference(x, idx, w, gu_q, gu_s, d_q, d_s), dtype)


def test_fp8_experts_need_both_scales_of_the_right_shape():
    from gemma4opt.ops.fp8 import quantize_rows_reference

    x, idx, w, gate_up, down = _case(1, 2, 4, 8, 16, torch.float32, seed=3)
    gu_q, gu_s = quantize_rows_reference(gate_up)
    d_q, d_s = quantize_rows_reference(down)
    with pytest.raises(ValueError, match="both scales"):
        moe_experts_triton(x, idx, w, gu_q, d_q, gate_up_scale=gu_s)
    with pytest.raises(ValueError, match="both scales"):
        moe_experts_triton(x, idx, w, gu_q, d_q, gate_up_scale=gu_s, down_scale=d_s.t())
