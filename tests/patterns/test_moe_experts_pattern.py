"""gemma4opt.moe_experts: its test oracle against HF's own experts path, and the layouts it refuses."""
from types import SimpleNamespace

import pytest
import torch

from gemma4opt.ops.moe_experts import moe_experts_reference, register_experts
from patterns.moe_experts import MoeExpertsPattern
from tests.models import tiny


def _experts(dtype):
    model = tiny("tiny-moe").to(dtype)
    experts = model.model.layers[0].experts
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():       # weights on the scale of a trained model's, so outputs are not ~0
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) / 8)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) / 4)
    return experts, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hfs_grouped_path(dtype):
    """The kernels' oracle gives what the model's experts module (HF's grouped GEMM path) gives,
    tokens sharing experts included."""
    experts, g = _experts(dtype)
    T, E, k, H = 7, experts.num_experts, 2, experts.hidden_dim
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    with torch.no_grad():
        want = experts(x, idx, w)
        got = moe_experts_reference(x, idx, w, experts.gate_up_proj, experts.down_proj)
    assert want.abs().mean() > 1e-3
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_op_runs_the_registered_module_off_cuda():
    experts, g = _experts(torch.float32)
    x = torch.randn(3, experts.hidden_dim, generator=g)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0]])
    w = torch.softmax(torch.randn(3, 2, generator=g), -1)
    key = register_experts(experts)
    with torch.no_grad():
        got = torch.ops.gemma4opt.moe_experts(x, idx, w, experts.gate_up_proj, experts.down_proj, key)
        assert torch.equal(got, experts(x, idx, w))


@pytest.mark.parametrize("attr,value", [("is_transposed", True), ("has_bias", True), ("has_gate", False)])
def test_other_expert_layouts_stay_unfused_with_a_reason(attr, value):
    module = SimpleNamespace(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True)
    setattr(module, attr, value)
    m, why = MoeExpertsPattern._match(SimpleNamespace(), module)
    assert m is None and f"{attr}={value}" in why


def test_report_lists_the_experts_picks():
    from gemma4opt.ops.state import OpState
    from gemma4opt.report import _decode_experts

    state = OpState()
    assert _decode_experts("cuda", state).startswith("no decode shape timed yet")
    state.shapes["moe_experts"].chosen.update({(1, 8, 128, 1408, 2816, None, 0): True,
                                               (8, 8, 128, 1408, 2816, None, 0): False})
    assert _decode_experts("cuda", state).startswith(
        "gemma4opt's decode kernels on 1 of 2 shapes timed (tokens [1, 8]), HF's experts path on the rest")
