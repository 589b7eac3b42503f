"""quantization="fp8" on CPU: the Fp8Linear swap and its drop-in behaviour, and greedy tokens of
the optimized model equal to the fp8 reference path (the same swap on an unoptimized copy, run by
HF's eager forward with the reference ops) on every tiny variant, in both attention modes."""
import copy

import pytest
import torch

import gemma4opt
from gemma4opt.ops.fp8 import FP8_DTYPE, quantize_weight_reference
from gemma4opt.ops.fp8_weights import QUANTIZED_BLOCKS, Fp8Experts, Fp8Linear, fp8_experts, fp8_linears, quantize_linears
from tests.models import VARIANTS, prompt, tiny
from tests.models import greedy as _generate

FP8 = gemma4opt.Gemma4OptConfig(quantization="fp8")


def _reference(model):
    ref = copy.deepcopy(model)
    quantize_linears(ref)
    return ref


@pytest.mark.parametrize("attention", ["hf", "paged"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tokens_equal_the_fp8_reference_path(variant, attention):
    model = tiny(variant)
    ref = _reference(model)
    ids = prompt(2, 11)
    want = _generate(ref, ids)
    assert not torch.equal(want, _generate(model, ids)), "fp8 changed no token: the test would not see a mix-up"
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(quantization="fp8", attention=attention))
    assert torch.equal(_generate(model, ids), want)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    rep = gemma4opt.report(model, print_table=False)
    assert all(r.complete for r in rep.rows), str(rep)
    L = model.config.num_hidden_layers
    assert rep.row("fp8_quant").matched == 3 * L
    # Each o_proj quantizing its input, each dense MLP one op (gate/up + gelu·mul + down).
    assert rep.row("quant_linear").matched == L
    assert rep.row("gelu_linear").matched == L + (L if model.config.hidden_size_per_layer_input else 0)


def test_every_attention_mlp_and_experts_weight_is_fp8_and_no_bf16_copy_is_kept():
    model = tiny("tiny-moe", dtype=torch.bfloat16)
    before = {n: p.shape for n, p in model.named_parameters()}
    gemma4opt.optimize(model, FP8)
    names = {n for blocks in QUANTIZED_BLOCKS.values() for n in blocks}
    swapped = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert swapped and all(n.rsplit(".", 1)[1] in names for n in swapped)
    assert not any(isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in names
                   for n, m in model.named_modules())
    params = dict(model.named_parameters())
    assert not any(n.rsplit(".", 2)[-2] in names for n in params), "a bf16 projection weight is still held"
    assert not any(".experts." in n for n in params), "a bf16 experts weight is still held"
    assert set(params) == {n for n in before if n.rsplit(".", 2)[-2] not in names and ".experts." not in n}
    for m in fp8_linears(model):
        assert m.weight.dtype == FP8_DTYPE and m.weight_scale.dtype == torch.float32
    experts = fp8_experts(model)
    assert len(experts) == model.config.num_hidden_layers
    for m in experts:
        assert m.gate_up_proj.dtype == m.down_proj.dtype == FP8_DTYPE
        assert m.gate_up_proj_scale.shape == m.gate_up_proj.shape[:2] and m.down_proj_scale.shape == m.down_proj.shape[:2]
    # merged q/k/v and gate/up: every projection's fp8 weight and scales are views of one tensor each
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.k_proj.weight.untyped_storage().data_ptr()


def test_weights_match_quantizing_the_bf16_weights():
    model = tiny("tiny", dtype=torch.bfloat16)
    want = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    gemma4opt.optimize(model, FP8)
    got = model.model.layers[1].mlp.down_proj
    q, s = quantize_weight_reference(want)
    assert torch.equal(got.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.weight_scale, s)


def test_experts_weights_match_quantizing_each_experts_rows():
    model = tiny("tiny-moe", dtype=torch.bfloat16)
    want = model.model.layers[1].experts.down_proj.detach().clone()
    gemma4opt.optimize(model, FP8)
    got = model.model.layers[1].experts
    assert isinstance(got, Fp8Experts)
    for e in range(want.shape[0]):
        q, s = quantize_weight_reference(want[e])
        assert torch.equal(got.down_proj[e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(got.down_proj_scale[e], s)


def test_to_dtype_keeps_fp8_bytes_and_fp32_scales():
    model = tiny("tiny", dtype=torch.bfloat16)
    gemma4opt.optimize(model, FP8)
    ids = prompt(1, 7)
    model.to(torch.float32)
    for m in fp8_linears(model):
        assert m.weight.dtype == FP8_DTYPE and m.weight_scale.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.float32
    ref = _reference(tiny("tiny", dtype=torch.bfloat16).to(torch.float32))
    assert torch.equal(_generate(model, ids, 4), _generate(ref, ids, 4))


@pytest.mark.parametrize("variant", ["tiny", "tiny-moe"])      # tiny-moe: the Fp8Experts too
def test_load_state_dict_of_the_unquantized_model_quantizes_it(variant):
    src = tiny(variant, seed=3)
    model = tiny(variant)
    gemma4opt.optimize(model, FP8)
    model.load_state_dict(src.state_dict(), strict=False)
    ref = _reference(tiny(variant, seed=3))
    ids = prompt(2, 9)
    assert torch.equal(_generate(model, ids, 4), _generate(ref, ids, 4))


def test_quantization_cannot_be_undone_or_saved(tmp_path):
    model = tiny("tiny")
    gemma4opt.optimize(model, FP8)
    with pytest.raises(ValueError, match="bf16 weights are gone"):
        gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig())
    assert gemma4opt.report(model, print_table=False).weights.startswith("fp8 e4m3")   # still the fp8 model
    with pytest.raises(NotImplementedError, match="quantization='fp8'"):
        model.save_pretrained(tmp_path)
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(quantization="fp8", attention="paged"))   # fp8 stays fp8
    assert len(fp8_linears(model)) == 4 * model.config.num_hidden_layers + 3 * model.config.num_hidden_layers \
        - _missing(model)


def _missing(model):
    """Projections a tiny variant does not own (k_eq_v: no v_proj; KV-shared layers: q_proj only)."""
    names = [n for blocks in QUANTIZED_BLOCKS.values() for n in blocks]
    return sum(getattr(m, n, None) is None for m in model.modules()
               if type(m).__name__ in QUANTIZED_BLOCKS for n in names if n in QUANTIZED_BLOCKS[type(m).__name__])


def test_report_names_what_is_fp8_and_what_is_not():
    model = tiny("tiny")
    plain = tiny("tiny")
    gemma4opt.optimize(model, FP8)
    gemma4opt.optimize(plain)
    ids = prompt(1, 5)
    _generate(model, ids, 2)
    _generate(plain, ids, 2)
    text = str(gemma4opt.report(model, print_table=False))
    assert "weights: fp8 e4m3" in text and "lm_head" in text and "MoE router" in text
    assert "MoE experts" not in text        # tiny has none
    assert "fp8_quant" in text and "weights:" not in str(gemma4opt.report(plain, print_table=False))
    assert "fp8_quant" not in str(gemma4opt.report(plain, print_table=False))
    moe = tiny("tiny-moe")
    gemma4opt.optimize(moe, FP8)
    _generate(moe, ids, 2)
    assert f"{moe.config.num_hidden_layers} MoE experts blocks (weight-only" in str(gemma4opt.report(moe, print_table=False))


def test_experts_forward_hooks_move_to_the_fp8_module():
    """tensor_parallel's all-reduce is a forward hook on each experts module: the swap keeps it."""
    model = tiny("tiny-moe")
    seen = []
    model.model.layers[0].experts.register_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
    quantize_linears(model)
    with torch.no_grad():
        model(prompt(1, 4))
    assert seen == ["Fp8Experts"]


@pytest.mark.parametrize("attention", ["hf", "paged"])
def test_the_swapped_out_bf16_modules_are_freed(attention):
    """optimize() records every attribute it sets to revert it; records of modules the swap took out
    of the model (the experts held a config copy) must not keep them, and their bf16 weights, alive."""
    import gc
    import weakref

    model = tiny("tiny-moe")
    old = [weakref.ref(m) for m in model.modules() if type(m).__name__ == "Gemma4TextExperts"]
    old += [weakref.ref(getattr(m, n)) for m in model.modules() for n in QUANTIZED_BLOCKS.get(type(m).__name__, ())
            if getattr(m, n, None) is not None]
    assert old
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(quantization="fp8", attention=attention))
    _generate(model, prompt(1, 5), 2)
    gc.collect()
    assert [r() for r in old if r() is not None] == []


def test_each_bf16_experts_module_is_freed_before_the_next_is_quantized(monkeypatch):
    """Peak memory: the bf16 experts go as each layer's are swapped, not when every layer's are done
    (on the 26b-a4b that is 52 GB of bf16 and 26 of fp8 at once, more than an 80 GB GPU holds)."""
    import gc
    import weakref

    from gemma4opt.ops import fp8_weights

    model = tiny("tiny-moe")
    seen, alive = [], []
    real = fp8_weights.Fp8Experts.from_experts.__func__

    def from_experts(cls, experts):
        gc.collect()
        alive.append(sum(r() is not None for r in seen))
        seen.append(weakref.ref(experts))
        return real(cls, experts)

    monkeypatch.setattr(fp8_weights.Fp8Experts, "from_experts", classmethod(from_experts))
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(quantization="fp8", attention="hf"))
    assert len(seen) >= 2 and alive == [0] * len(seen)
