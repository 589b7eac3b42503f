"""On the GPU machine: rope_cos_sin's Triton kernel gives PyTorch's bits at every position of each
preset's context, for both forms of HF's product, and replays in a CUDA graph with new positions."""
import pytest
import torch
from transformers.models.gemma4 import modeling_gemma4

from gemma4opt.kernels.rope_cos_sin import rope_cos_sin_triton
from gemma4opt.ops.rope_cos_sin import kernel_matches, rope_cos_sin_reference, uses_kernel
from gemma4opt.presets import PRESETS, preset_config

pytestmark = pytest.mark.gpu


def _rotary(preset):
    cfg = preset_config(preset, layers=2)
    return cfg, modeling_gemma4.Gemma4TextRotaryEmbedding(cfg).to("cuda")


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("matmul", [False, True])
def test_kernel_bits_equal_pytorchs_over_the_whole_context(preset, matmul):
    cfg, rotary = _rotary(preset)
    for kind in sorted(set(cfg.layer_types)):
        inv = getattr(rotary, f"{kind}_inv_freq")
        scaling = getattr(rotary, f"{kind}_attention_scaling")
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert kernel_matches(inv, scaling, dtype, matmul, cfg.max_position_embeddings), (kind, dtype)
        assert uses_kernel(inv, scaling, torch.bfloat16, matmul, cfg.max_position_embeddings) is True


def test_graph_replays_new_positions_with_the_references_bits():
    cfg, rotary = _rotary("e4b")
    inv = rotary.sliding_attention_inv_freq
    pos = torch.zeros(8, 1, dtype=torch.long, device="cuda")
    cos, sin = rope_cos_sin_triton(pos, inv, 1.0, torch.bfloat16)        # compile outside the capture
    assert uses_kernel(inv, 1.0, torch.bfloat16, False, cfg.max_position_embeddings)   # checked: the kernel is captured
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cos, sin = torch.ops.gemma4opt.rope_cos_sin(pos, inv, 1.0, torch.bfloat16, False, cfg.max_position_embeddings)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(5):
        pos.copy_(torch.randint(0, cfg.max_position_embeddings, (8, 1), device="cuda", generator=g))
        graph.replay()
        want = rope_cos_sin_reference(pos, inv, 1.0, torch.bfloat16, False)
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
