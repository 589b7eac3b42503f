"""Every fusion on the real HF modules of each tiny variant: exact counts, numerics, nothing left behind."""
import collections

import pytest
import torch

from gemma4opt.patterns import PATTERN_NAMES, build_patterns
from tests.models import VARIANTS, prompt, tiny
from tests.patterns.helpers import Compiled

# Patterns that match on what an earlier one produced.
NEEDS = {"norm_rope": ["rms_norm"], "residual_norm": ["rms_norm"], "moe_router": ["rms_norm"],
         "norm_add": ["rms_norm", "residual_norm"],
         "gelu_tanh_mul": ["merged_projections"],
         "gate_up_gelu": ["merged_projections", "gelu_tanh_mul", "decode_linear"],
         "gelu_linear": ["merged_projections", "gelu_tanh_mul", "decode_linear"],
         "norm_linear": ["rms_norm", "merged_projections", "residual_norm", "norm_add", "decode_linear"],
         "moe_streams": ["moe_experts"]}
# Ops of the fused blocks that must not survive the pass.
GONE = {"gelu_tanh_mul": ["gelu"], "norm_rope": ["neg"], "logit_softcap": ["tanh"],
        "moe_router": ["topk", "softmax", "itruediv"], "residual_norm": ["imul"],
        "moe_experts": ["sort", "histc", "cumsum", "grouped_mm", "_grouped_mm", "grouped_mm_fallback", "bmm",
                        "repeat_interleave"]}


def _run(variant, names):
    model = tiny(variant)
    ids = prompt(2, 11)
    with torch.no_grad():
        want = model(ids).logits
    c = Compiled(model, names, text_config=model.config)
    return c, c(ids).logits, want, model.config


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pattern", [p for p in PATTERN_NAMES if p != "rms_norm" and not build_patterns()[p].paged_only
                                     and not build_patterns()[p].quantized_only])   # those: tests/quant
def test_pattern_count_numerics_coverage(variant, pattern):
    names = NEEDS.get(pattern, []) + [pattern]
    c, got, want, cfg = _run(variant, names)
    expected = build_patterns()[pattern].expected(cfg, "causal_lm")
    assert c.matched(pattern) == expected, c.unfused(pattern)
    assert c.unfused(pattern) == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ops = c.ops()
    for op in GONE.get(pattern, []):
        assert ops[op] == 0, (op, ops)


def _linears_by_weight(c):
    """Linear nodes of the last rewritten graph, keyed by the projection whose weight they read."""
    from gemma4opt.compiler.regions import op_name

    out = collections.Counter()
    for n in c.graphs[-1].graph.nodes:
        if n.op.startswith("call") and op_name(n) == "linear":
            w = str(n.args[1])
            proj = next((p for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") if f"_{p}_" in w), None)
            out["merged" if w.endswith("_merged") else proj or "other"] += 1
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_projections_leave_no_separate_projection(variant):
    """After merged_projections no linear reads a k/v/gate/up weight on its own, q_proj is left
    only in KV-shared layers (they own nothing to merge it with), one merged GEMM per match, and
    every other linear is untouched."""
    ids = prompt(2, 11)
    before = Compiled(tiny(variant), [], text_config=tiny(variant).config)
    before(ids)
    c, got, want, cfg = _run(variant, ["merged_projections"])
    b, a = _linears_by_weight(before), _linears_by_weight(c)
    assert b["merged"] == 0 and b["k_proj"] > 0 and b["gate_proj"] > 0          # the pass had work to do
    assert a["k_proj"] == a["v_proj"] == a["gate_proj"] == a["up_proj"] == 0, a
    assert a["q_proj"] == (cfg.num_kv_shared_layers or 0), a
    assert a["merged"] == c.matched("merged_projections") > 0
    assert a["other"] == b["other"], (a, b)


def test_moe_experts_matches_hfs_decode_path_batched_mm():
    """HF's generate runs decode steps on a GPU with the batched_mm experts implementation: the
    same count, the same logits, and no bmm left."""
    model = tiny("tiny-moe")
    model.set_experts_implementation("batched_mm")
    ids = prompt(2, 5)
    with torch.no_grad():
        want = model(ids).logits
    c = Compiled(model, ["moe_experts"], text_config=model.config)
    got = c(ids).logits
    assert c.matched("moe_experts") == model.config.num_hidden_layers, c.unfused("moe_experts")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert c.ops()["bmm"] == 0 and c.ops()["repeat_interleave"] == 0


def test_all_patterns_together_leave_no_norm_math():
    c, got, want, cfg = _run("tiny-ple-shared", list(PATTERN_NAMES))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ops = c.ops()
    for op in ("pow", "mean", "type_as", "gelu", "tanh", "neg"):
        assert ops[op] == 0, (op, ops)
    fused = c.gemma4opt_ops()
    L, shared = cfg.num_hidden_layers, cfg.num_kv_shared_layers
    assert fused["rms_norm_rope"] == 2 * L - shared
    # Every residual tail fused (each attention tail, each layer's end, each post-feedforward tail,
    # the PLE inputs' combine), those feeding a GEMM inside it: each layer's end but the last, and
    # each post-feedforward tail, whose sums feed the next q/k/v and the per-layer-input gate.
    assert fused["norm_linear"] == 2 * L - 1
    assert fused["add_rms_norm"] == 2 * L - (L - 1)
    assert fused["norm_add"] == L + 1 - L
    assert fused["linear_softcap"] == 1
    assert fused["gelu_linear"] == L        # each layer's PLE gelu·mul, inside its projection
    assert fused["gate_up_gelu_linear"] == L and fused["gate_up_gelu"] == 0     # each MLP's, with its down


def test_merged_weights_are_views_not_copies():
    model = tiny("tiny-k-eq-v")
    before = sum(p.numel() for p in model.parameters())
    Compiled(model, ["merged_projections"], text_config=model.config)
    attn = model.model.layers[1].self_attn
    merged = attn._gemma4opt_merged_weight
    assert attn.q_proj.weight.data_ptr() == merged.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    assert "_gemma4opt_merged_weight" not in "".join(model.state_dict())


def test_norm_rope_refuses_non_rope_consumer():
    """A q_norm whose output is used elsewhere too keeps its plain rms_norm, with a reason."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_norm = Gemma4RMSNorm(8)

        def forward(self, x, cos, sin):
            y = self.q_norm(x)
            rot = torch.cat((-y[..., 4:], y[..., :4]), dim=-1)
            return y * cos + rot * sin, y.sum()

    m = Attn()
    x, cos, sin = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    c = Compiled(m, ["rms_norm", "norm_rope"])
    out = c(x, cos, sin)
    assert c.matched("norm_rope") == 0
    assert "not consumed by a rotate_half RoPE" in c.unfused("norm_rope")[0]
    torch.testing.assert_close(out[0], m(x, cos, sin)[0])


def test_moe_router_takes_the_experts_input_norm():
    """The experts' input norm (pre_feedforward_layernorm_2) reads the router's x: it comes out of
    gemma4opt.moe_router_norm, and no gemma4opt.rms_norm of that x is left."""
    c, got, want, cfg = _run("tiny-moe", ["rms_norm", "moe_router", "moe_experts"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fused = c.gemma4opt_ops()
    assert fused["moe_router_norm"] == cfg.num_hidden_layers and fused["moe_router"] == 0
    assert c.matched("moe_experts") == cfg.num_hidden_layers
    from gemma4opt.compiler.regions import op_name

    for n in c.graphs[-1].graph.nodes:
        if op_name(n) == "moe_router_norm.default":
            assert not [u for u in n.args[0].users if op_name(u) == "rms_norm.default"]
