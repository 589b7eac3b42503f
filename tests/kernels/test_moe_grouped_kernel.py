"""kernels/moe_grouped.py (decode batches above the pair-by-pair kernels' 64 pairs: each expert's
weights read once for its pairs) against the pair-by-pair oracle."""
import pytest
import torch

from gemma4opt.kernels.moe_experts import MAX_PAIRS, moe_experts_triton
from gemma4opt.kernels.moe_grouped import MAX_GROUPED_PAIRS, PP
from gemma4opt.ops.moe_experts import moe_experts_reference, pick_tokens
from tests.kernels.conftest import DEVICE, DTYPES, close
from tests.kernels.test_moe_experts_kernel import _case

SMALL = dict(gu=(16, 16, 4, 1), dn=(16, 16, 4, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,k,E,I,H", [(3, 4, 6, 17, 33), (40, 2, 3, 12, 20), (9, 8, 20, 24, 40), (5, 3, 16, 9, 19)])
def test_matches_reference(dtype, T, k, E, I, H):
    """Odd widths (partial weight and K tiles), top-k not a power of two, experts with no pair
    (9 x 8 over 20), and experts with more pairs than one dot takes (40 x 2 over 3: ~27 > PP)."""
    x, idx, w, gate_up, down = _case(T, k, E, I, H, dtype, seed=T * 100 + k)
    close(moe_experts_triton(x, idx, w, gate_up, down, launch=SMALL, grouped=True),
          moe_experts_reference(x, idx, w, gate_up, down), dtype)


def test_one_expert_takes_every_token_in_several_chunks():
    """Every token routed to expert 2 (3 x PP + 5 pairs there), its other slot spread over the rest."""
    T = 3 * PP + 5
    x, idx, w, gate_up, down = _case(T, 2, 5, 12, 24, torch.float32, seed=5)
    idx[:, 0] = 2
    idx[:, 1] = torch.arange(T, device=DEVICE) % 2 + 3
    close(moe_experts_triton(x, idx, w, gate_up, down, launch=SMALL, grouped=True),
          moe_experts_reference(x, idx, w, gate_up, down), torch.float32)


def test_above_the_pair_by_pair_limit_runs_grouped():
    """33 tokens of top-2 (66 pairs > MAX_PAIRS): the grouped kernels, without being asked; a
    strided x (a column slice of a wider buffer)."""
    T, k = MAX_PAIRS // 2 + 1, 2
    x, idx, w, gate_up, down = _case(T, k, 7, 10, 18, torch.bfloat16, seed=9)
    wide = torch.zeros(T, 30, dtype=x.dtype, device=DEVICE)
    wide[:, 4:22] = x
    with pytest.raises(ValueError, match=f"at most {MAX_PAIRS}"):
        moe_experts_triton(x, idx, w, gate_up, down, grouped=False)
    close(moe_experts_triton(wide[:, 4:22], idx, w, gate_up, down, launch=SMALL),
          moe_experts_reference(x, idx, w, gate_up, down), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_experts_match_reference(dtype):
    from gemma4opt.ops.fp8 import quantize_rows_reference
    from gemma4opt.ops.moe_experts_fp8 import moe_experts_fp8_reference

    x, idx, w, gate_up, down = _case(11, 6, 9, 17, 33, dtype, seed=4)
    gu_q, gu_s = quantize_rows_reference(gate_up)
    d_q, d_s = quantize_rows_reference(down)
    got = moe_experts_triton(x, idx, w, gu_q, d_q, launch=SMALL, gate_up_scale=gu_s, down_scale=d_s, grouped=True)
    close(got, moe_experts_fp8_reference(x, idx, w, gu_q, gu_s, d_q, d_s), dtype)


def test_refuses_more_pairs():
    x, idx, w, gate_up, down = _case(1, 2, 4, 8, 16, torch.float32, seed=1)
    many = MAX_GROUPED_PAIRS // 2 + 1
    with pytest.raises(ValueError, match=f"at most {MAX_GROUPED_PAIRS}"):
        moe_experts_triton(x.expand(many, -1), idx.expand(many, -1), w.expand(many, -1), gate_up, down)


def test_picks_keyed_by_token_bucket_above_eight():
    assert [pick_tokens(t) for t in (1, 5, 8, 9, 16, 17, 33, 128)] == [1, 5, 8, 16, 16, 32, 64, 128]


def test_report_states_the_grouped_limit():
    """report.py names the limit without importing Triton (CPU installs may lack it): kept in step here."""
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module("gemma4opt.report"))
    assert f"up to {MAX_GROUPED_PAIRS} (token, expert) pairs" in source
