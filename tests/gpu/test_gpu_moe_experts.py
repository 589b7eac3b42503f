"""On the GPU machine: gemma4opt's decode experts kernels at the 26b-a4b's real dimensions against
the oracle, and the op against HF's experts module whichever path each shape picked."""
import pytest
import torch

from gemma4opt.kernels.moe_experts import moe_experts_triton
from gemma4opt.ops import moe_experts as moe_op
from gemma4opt.presets import preset_config

pytestmark = pytest.mark.gpu


def _experts_module(E=128, I=704, H=2816):
    cfg = preset_config("26b-a4b")
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size) == (E, I, H)
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    cfg._experts_implementation = "grouped_mm"
    m = Gemma4TextExperts(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, H ** -0.5)
        m.down_proj.normal_(0, I ** -0.5)
    return m, cfg.top_k_experts


def _routed(m, k, tokens):
    """tokens rows of bf16 input, each routed to k distinct experts with fp32 weights (seeded by tokens)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, m.hidden_dim, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(m.num_experts, device="cuda", generator=g)[:k] for _ in range(tokens)])
    return x, idx, torch.softmax(torch.randn(tokens, k, device="cuda", generator=g), -1)


@pytest.mark.parametrize("tokens", [1, 3, 8, 13, 32, 64])
def test_kernels_and_op_match_hf_at_real_dims(tokens):
    """Pair by pair up to 8 tokens of top-8, expert by expert (kernels/moe_grouped.py) above."""
    m, k = _experts_module()
    x, idx, w = _routed(m, k, tokens)
    with torch.no_grad():
        want = m(x, idx, w).float()
        got = moe_experts_triton(x, idx, w, m.gate_up_proj, m.down_proj).float()
        ref = moe_op.moe_experts_reference(x, idx, w, m.gate_up_proj, m.down_proj).float()
        op = torch.ops.gemma4opt.moe_experts(x, idx, w, m.gate_up_proj, m.down_proj, moe_op.register_experts(m))
    for out in (got, ref, op.float()):
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    key = (moe_op.pick_tokens(tokens), k, m.num_experts, 2 * m.intermediate_dim, m.hidden_dim, torch.bfloat16, x.device.index)
    assert key in moe_op.picks() and key not in moe_op.failures()


@pytest.mark.parametrize("tokens", [16, 48, 256])
def test_fp8_grouped_kernels_match_reference_at_real_dims(tokens):
    """quantization="fp8" experts above 64 pairs: the e4m3 rows converted in the grouped kernels'
    tiles (compiled tl.dot; the interpreter tests run fp32 dots) against the op's reference; above
    1024 pairs (256 tokens: a prefill) the batched tensor-core GEMMs with fp32 sums."""
    from gemma4opt.kernels.moe_grouped import MAX_GROUPED_PAIRS
    from gemma4opt.ops.fp8 import quantize_rows_reference
    from gemma4opt.ops.moe_experts_fp8 import moe_experts_fp8_reference

    m, k = _experts_module()
    x, idx, w = _routed(m, k, tokens)
    with torch.no_grad():
        gu_q, gu_s = quantize_rows_reference(m.gate_up_proj)
        d_q, d_s = quantize_rows_reference(m.down_proj)
        want = moe_experts_fp8_reference(x, idx, w, gu_q, gu_s, d_q, d_s).float()
        got = torch.ops.gemma4opt.moe_experts_fp8(x, idx, w, gu_q, gu_s, d_q, d_s).float()
    assert (tokens * k > MAX_GROUPED_PAIRS) == (tokens == 256)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
