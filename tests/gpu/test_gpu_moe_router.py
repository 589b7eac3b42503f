"""On the GPU machine: the MoE router op (gemma4opt.moe_router_norm) at the 26b-a4b's dimensions, at
decode rows (the one-launch kernel, its last-program hand-off across real concurrent programs) and
above (input kernel, GEMM, top-k), against HF's router module and norm; and the one-launch kernel
replayed in a CUDA graph on new inputs (its counts must come back to zero every call)."""
import pytest
import torch

import gemma4opt  # noqa: F401  (registers the ops)
from gemma4opt.kernels import moe_router_decode as rd
from gemma4opt.ops.rms_norm import rms_norm_reference
from gemma4opt.presets import preset_config

pytestmark = pytest.mark.gpu


def _router():
    cfg = preset_config("26b-a4b")
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    m = Gemma4TextRouter(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        m.proj.weight.normal_(0, cfg.hidden_size ** -0.5)
        m.scale.normal_(1, 0.2)
        m.per_expert_scale.normal_(1, 0.2)
    return m, cfg


def _op(m, cfg, x, w2):
    return torch.ops.gemma4opt.moe_router_norm(x, m.scale, m.proj.weight, m.per_expert_scale, cfg.rms_norm_eps,
                                               float(m.scalar_root_size), cfg.top_k_experts, w2, cfg.rms_norm_eps)


@pytest.mark.parametrize("tokens", [1, 5, 32, 33, 200])
def test_router_op_matches_hf(tokens):
    m, cfg = _router()
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(tokens, cfg.hidden_size, device="cuda", generator=g) * 2).to(torch.bfloat16)
    w2 = (1 + 0.2 * torch.randn(cfg.hidden_size, device="cuda", generator=g)).to(torch.bfloat16)
    with torch.no_grad():
        want_p, want_w, want_i = m(x)
        probs, w, idx, n = _op(m, cfg, x, w2)
    torch.testing.assert_close(probs, want_p.float(), rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(n.float(), rms_norm_reference(x, w2, cfg.rms_norm_eps).float(), rtol=2e-2, atol=2e-2)
    # Logits summed in another order than cuBLAS's can swap near-equal experts; nearly all agree.
    agree = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(idx, want_i)) / want_i.numel()
    assert agree >= 0.95, agree
    same = (idx == want_i).all(-1)
    torch.testing.assert_close(w[same], want_w.float()[same], rtol=2e-2, atol=1e-3)


def test_one_launch_router_replays_in_a_cuda_graph():
    m, cfg = _router()
    H = cfg.hidden_size
    x = torch.randn(4, H, device="cuda").to(torch.bfloat16)
    w2 = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    args = (m.scale, m.proj.weight, m.per_expert_scale, cfg.rms_norm_eps, float(m.scalar_root_size), cfg.top_k_experts)
    assert rd.router_decode_supported(x, m.scale, m.proj.weight, cfg.top_k_experts, w2)
    with torch.no_grad():
        rd.router_decode_triton(x, *args, w2, 1e-6)          # compiled and the counts made before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rd.router_decode_triton(x, *args, w2, 1e-6)
        for seed in range(3):
            x.copy_(torch.randn(4, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
            graph.replay()
            want = rd.router_decode_triton(x.clone(), *args, w2, 1e-6)
            for a, b in zip(out, want):
                assert torch.equal(a, b)
    assert int(rd._COUNTS[x.device].abs().sum()) == 0
