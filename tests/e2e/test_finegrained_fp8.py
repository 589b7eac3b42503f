"""A model loaded through transformers' FineGrainedFP8 quantization (built here by transformers' own
replace_with_fp8_linear and Fp8Quantize: no checkpoint can be downloaded): its FP8Linear projections
run gemma4opt::fp8_block_linear, and generate's tokens and the logits equal the FP8 reference path
(the same modules, unoptimized, each forward the op's reference: the semantics of transformers'
kernel, which loads from the `kernels` hub and cannot run here). The modules stay transformers'
(type, parameters, state_dict); only their forward, an instance attribute, is gemma4opt's, and
optimize() takes it back with everything else."""
import pytest
import torch

import gemma4opt
import gemma4opt.api as api
from gemma4opt import Gemma4OptConfig
from gemma4opt.compiler.pattern import BLOCK_FP8_WHY
from gemma4opt.edits import InstanceEdits
from gemma4opt.ops.fp8 import FP8_DTYPE
from gemma4opt.ops.fp8_checkpoint import (adopt_fp8_modules, adopted, experts_unsupported, is_hf_fp8_linear,
                                          unsupported)
from gemma4opt.presets import build_model, finegrained_fp8_
from tests.models import VARIANTS, fp8_checkpoint_reference, greedy, prompt, tiny

PAGED = dict(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)


def _checkpoint(variant="tiny", block=(32, 32)):
    # tiny-moe's experts (transformers' FP8Experts) 32 wide, not 16: whole 32 x 32 blocks, quantized
    wide = dict(moe_intermediate_size=32) if variant == "tiny-moe" else {}
    return finegrained_fp8_(build_model(variant, **wide), block)


def _op_forward(self, x):
    return torch.ops.gemma4opt.fp8_block_linear(x, self.weight, self.weight_scale_inv, *self.block_size)


def _fp8_linears(model):
    return [m for m in model.modules() if is_hf_fp8_linear(m) and m.weight.dtype == FP8_DTYPE]


@pytest.mark.parametrize("variant,attention", [(v, "paged") for v in VARIANTS] + [("tiny", "hf")])
def test_tokens_and_logits_equal_the_fp8_reference_path(variant, attention):
    model = _checkpoint(variant)
    ref = fp8_checkpoint_reference(model)
    ids = prompt(2, 11)
    want = greedy(ref, ids)
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    cfg = Gemma4OptConfig(**PAGED) if attention == "paged" else Gemma4OptConfig(attention=attention)
    gemma4opt.optimize(model, cfg)
    assert torch.equal(greedy(model, ids), want)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    lins = _fp8_linears(model)
    assert lins and all(adopted(m) and type(m).__name__ == "FP8Linear" for m in lins)
    # every graph gemma4opt rewrote (prefill, decode) calls the op, once per fp8 projection it runs
    counts = model._gemma4opt.pass_manager.op_counts
    assert counts and all(c["gemma4opt.fp8_block_linear"] >= 4 * model.config.num_hidden_layers - 8 for c in counts)
    after = model.state_dict()          # the checkpoint's tensors: same names, dtypes and values
    assert after.keys() == before.keys()
    assert all(after[k].dtype == d and torch.equal(after[k].view(torch.uint8) if d == FP8_DTYPE else after[k],
                                                   v.view(torch.uint8) if d == FP8_DTYPE else v)
               for k, (d, v) in before.items())


def test_ue8m0_scales_run_and_equal_the_reference_path():
    """scale_fmt="ue8m0" (transformers rounds each tile's scale up to a power of two and stores its
    exponent byte): adopted, the kernel reads the bytes; tokens and logits of the reference path."""
    model = finegrained_fp8_(tiny("tiny"), (32, 32), scale_fmt="ue8m0")
    lins = _fp8_linears(model)
    assert lins and all(m.weight_scale_inv.dtype == torch.float8_e8m0fnu for m in lins)
    ref = fp8_checkpoint_reference(model)
    ids = prompt(2, 9)
    want = greedy(ref, ids)
    gemma4opt.optimize(model, Gemma4OptConfig(**PAGED))
    assert torch.equal(greedy(model, ids), want) and all(adopted(m) for m in lins)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_report_says_what_runs_which_forward():
    model = _checkpoint("tiny-ple-shared")
    gemma4opt.optimize(model, Gemma4OptConfig(**PAGED))
    with torch.no_grad():
        model(prompt(1, 7))
    rep = gemma4opt.report(model, print_table=False)
    n = len([m for m in _fp8_linears(model) if adopted(m)])
    assert f"{n} linears are transformers' FP8Linear" in rep.weights and "32 x 32 tile" in rep.weights
    assert "32-long group" in rep.weights
    # the per-layer-input projections' 8-wide weights are no multiple of the block: left in fp32 by
    # transformers, their own forward (F.linear) runs
    assert "FP8Linear run their own forward: the checkpoint left its weight in float32" in rep.weights
    assert "quantized checkpoint's own modules" not in rep.weights
    row = rep.row("merged_projections")     # each q/k/v and gate/up: one block-scaled GEMM
    assert row.complete and row.matched == row.expected > 0, (row.matched, row.expected, row.unfused)
    # The fusions that take a plain linear leave the block-scaled projections by design: each pattern
    # is complete on the rest (the fp32 per-layer-input projections), its other sites listed as not
    # applicable, not as unfused. 5 layers: q/k/v and the MLP (decode_linear), the MLP's gate/up and
    # down (gate_up_gelu, gelu_linear), the next layer's q/k/v reading a layer's tail (norm_linear).
    L = model.config.get_text_config().num_hidden_layers
    for name, na in (("decode_linear", 2 * L), ("gate_up_gelu", L), ("gelu_linear", L), ("norm_linear", L - 1)):
        row = rep.row(name)
        assert row.complete and not row.unfused, (name, row.matched_per_graph, row.unfused)
        assert set(row.not_applicable_per_graph) == {na} and row.not_applicable == [BLOCK_FP8_WHY], name
    ran = [r for r in rep.rows if r.matched_per_graph]      # (the paged-only ones: no paged graph yet)
    assert all(r.complete for r in ran), [(r.pattern, r.matched_per_graph, r.expected) for r in ran]
    assert f"not applicable at {L - 1} of its {2 * L - 1} sites: {BLOCK_FP8_WHY}" in str(rep)


def test_fp8_experts_run_gemma4opts_op_and_are_reported():
    model = _checkpoint("tiny-moe")
    experts = [m for m in model.modules() if type(m).__name__ == "FP8Experts"]
    assert len(experts) == 4 and all(e.gate_up_proj.dtype == e.down_proj.dtype == FP8_DTYPE for e in experts)
    gemma4opt.optimize(model, Gemma4OptConfig(**PAGED))
    greedy(model, prompt(1, 7), 3)
    assert all(adopted(e) for e in experts)
    rep = gemma4opt.report(model, print_table=False)
    assert "4 MoE experts blocks are transformers' FP8Experts: run by gemma4opt's moe_experts_fp8_block" in rep.weights
    row = rep.row("moe_experts")
    assert row.complete and row.matched == 4, (row.matched, row.unfused)
    assert all(c["gemma4opt.moe_experts_fp8_block"] == 4 for c in model._gemma4opt.pass_manager.op_counts)


def test_fp8_experts_with_a_stack_left_unquantized_run_it_as_transformers_does():
    """tiny-moe's own 16-wide experts at 32 x 32 blocks: transformers quantizes gate_up [E, 32, 64]
    and leaves down [E, 64, 16] in fp32 (F.linear in FP8Experts' forward): both run by gemma4opt's op,
    generate's tokens those of the reference path."""
    model = finegrained_fp8_(tiny("tiny-moe"), (32, 32))
    experts = [m for m in model.modules() if type(m).__name__ == "FP8Experts"]
    assert all(e.gate_up_proj.dtype == FP8_DTYPE and e.down_proj.dtype == torch.float32 for e in experts)
    ids = prompt(2, 9)
    want = greedy(fp8_checkpoint_reference(model), ids)
    gemma4opt.optimize(model, Gemma4OptConfig(**PAGED))
    assert torch.equal(greedy(model, ids), want)
    assert all(adopted(e) for e in experts)


def test_fp8_experts_the_op_does_not_take_keep_their_own_forward_with_the_reason():
    model = _checkpoint("tiny-moe")
    experts = next(m for m in model.modules() if type(m).__name__ == "FP8Experts")
    assert experts_unsupported(experts) is None
    experts.activation_scheme = "static"
    assert "activation_scheme='static'" in experts_unsupported(experts)
    experts.activation_scheme = "dynamic"
    experts.limit = 7.0
    assert "unclamped" in experts_unsupported(experts)
    counts = adopt_fp8_modules(model, InstanceEdits())
    assert counts["FP8Experts"] == 3 and sum(v for k, v in counts.items() if k.startswith("FP8Experts kept")) == 1
    assert not adopted(experts)


def test_optimize_again_and_a_failed_optimize_leave_transformers_forward():
    model = _checkpoint()
    ids = prompt(1, 9)
    want = greedy(fp8_checkpoint_reference(model), ids)
    gemma4opt.optimize(model, Gemma4OptConfig(**PAGED))
    with pytest.warns(UserWarning, match="re-optimizing"):
        gemma4opt.optimize(model, Gemma4OptConfig(attention="hf"))
    assert all(adopted(m) for m in _fp8_linears(model))
    assert torch.equal(greedy(model, ids), want)
    model._gemma4opt.edits.revert()
    assert all("forward" not in vars(m) for m in _fp8_linears(model))

    fresh = _checkpoint()

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "MergedWeightWatch", boom)      # after the FP8Linear forwards were set
        with pytest.raises(RuntimeError, match="injected"):
            gemma4opt.optimize(fresh, Gemma4OptConfig(**PAGED))
    assert all("forward" not in vars(m) for m in _fp8_linears(fresh)) and not hasattr(fresh, "_gemma4opt")


def test_quantization_fp8_keeps_the_checkpoints_fp8_and_says_so():
    model = _checkpoint()
    ids = prompt(2, 9)
    want = greedy(fp8_checkpoint_reference(model), ids)
    gemma4opt.optimize(model, Gemma4OptConfig(quantization="fp8", **PAGED))
    assert torch.equal(greedy(model, ids), want)
    assert all(adopted(m) for m in _fp8_linears(model))
    rep = gemma4opt.report(model, print_table=False)
    assert "not quantized, transformers' FP8Linear (the checkpoint's own fp8)" in rep.weights


def test_loss_and_its_gradient_equal_the_reference_path():
    """A training-style call (labels, grad enabled) on the optimized model: the loss and the
    embedding's gradient of the unoptimized model whose FP8Linear forwards call the op (its backward:
    the input's gradient through the dequantized weight, as transformers' FP8Linear)."""
    model = _checkpoint()
    ref = fp8_checkpoint_reference(model, _op_forward)
    ids = prompt(2, 9)
    gemma4opt.optimize(model, Gemma4OptConfig(**PAGED))
    losses, grads = [], []
    for m in (ref, model):
        m.zero_grad()
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(m.get_input_embeddings().weight.grad.clone())
    torch.testing.assert_close(losses[1], losses[0])
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("edit,why", [
    (lambda m: setattr(m, "activation_scheme", "static"), "activation_scheme='static'"),
    (lambda m: setattr(m, "block_size", (32, 48)), "gemma4opt's kernel takes a block_k of 32, 64, 128, 256"),
    (lambda m: setattr(m, "block_size", None), "one scale for the whole weight"),
    (lambda m: setattr(m, "weight_scale_inv", torch.nn.Parameter(m.weight_scale_inv.half(), requires_grad=False)),
     "weight_scale_inv (2, 2) float16 for a (64, 64) weight in (32, 32) blocks (gemma4opt takes (2, 2) "
     "float32 or UE8M0)"),
    (lambda m: setattr(m, "weight_scale_inv", torch.nn.Parameter(m.weight_scale_inv[:1], requires_grad=False)),
     "weight_scale_inv (1, 2) float32 for a (64, 64) weight"),
    (lambda m: setattr(m, "bias", torch.nn.Parameter(torch.zeros(64))), "a bias"),
])
def test_what_the_gemm_does_not_take_keeps_its_own_forward_with_the_reason(edit, why):
    model = _checkpoint()
    lin = model.model.layers[0].self_attn.q_proj
    assert unsupported(lin) is None
    edit(lin)
    assert why in unsupported(lin)
    counts = adopt_fp8_modules(model, InstanceEdits())
    kept = [k for k in counts if k.startswith("FP8Linear kept")]
    assert len(kept) == 1 and why in kept[0] and counts[kept[0]] == 1
    assert not adopted(lin) and adopted(model.model.layers[0].self_attn.k_proj)


def test_merged_scales_follow_edits_after_optimize():
    """q/k/v and gate/up read one merged weight and one merged scale tensor: a projection's scales
    replaced after optimize() (a new Parameter) are copied into their rows of the merged ones, so the
    next generate equals the reference path with the same edit."""
    model = _checkpoint()
    ids = prompt(2, 9)
    gemma4opt.optimize(model, Gemma4OptConfig(**PAGED))
    greedy(model, ids)
    ref = fp8_checkpoint_reference(model)
    with torch.no_grad():
        before = ref(ids).logits
    for m in (model, ref):
        # one K group's scales only: k is normed per head, so a uniform factor would change nothing
        attn = m.model.layers[1].self_attn
        s = attn.k_proj.weight_scale_inv.detach().clone()
        s[:, 0] *= 3
        attn.k_proj.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
        mlp = m.model.layers[2].mlp
        mlp.up_proj.weight_scale_inv.data = mlp.up_proj.weight_scale_inv.data.flip(0).contiguous()
    assert torch.equal(greedy(model, ids), greedy(ref, ids))
    with torch.no_grad():
        after = ref(ids).logits
        assert not torch.equal(after, before)
        assert torch.equal(model(ids).logits, after)
    assert any("k_proj.weight_scale_inv" in r for r in model._gemma4opt.weights.restored)


def test_projections_merge_only_when_their_tiles_stack():
    """Row blocks of 64: k_proj's 32 rows are half a block, so transformers left it unquantized
    (its own forward) and q/k/v stay apart; the MLP's 96 rows are not whole blocks either."""
    from patterns.merged_projections import MERGED_ATTR

    model = _checkpoint(block=(64, 32))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert adopted(attn.q_proj) is False and attn.k_proj.weight.dtype == torch.float32
    ids = prompt(1, 9)
    want = greedy(fp8_checkpoint_reference(model), ids)
    gemma4opt.optimize(model, Gemma4OptConfig(**PAGED))
    assert torch.equal(greedy(model, ids), want)
    assert adopted(attn.q_proj) and not adopted(attn.k_proj)
    assert MERGED_ATTR not in vars(attn) and MERGED_ATTR not in vars(mlp)
