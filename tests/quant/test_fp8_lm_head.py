"""quantize_lm_head=True on CPU: the lm_head in e4m3 beside the bf16 embedding table it was tied to,
its softcap fused as the fp8 GEMM's epilogue, and tokens and logits equal to the fp8 reference path
(the same swaps on an unoptimized copy, run by HF's eager forward)."""
import copy

import pytest
import torch

import gemma4opt
from gemma4opt.ops.fp8 import FP8_DTYPE, quantize_weight_reference
from gemma4opt.ops.fp8_weights import Fp8Linear, quantize_linears, quantize_lm_head
from tests.models import VARIANTS, prompt, tiny
from tests.models import greedy as _generate

FP8_HEAD = dict(quantization="fp8", quantize_lm_head=True)


def _reference(model):
    ref = copy.deepcopy(model)
    quantize_linears(ref)
    assert quantize_lm_head(ref) == {"Fp8Linear lm_head": 1}
    return ref


@pytest.mark.parametrize("variant,attention", [(v, "paged") for v in VARIANTS] + [("tiny", "hf")])
def test_tokens_and_logits_equal_the_fp8_reference_path(variant, attention):
    model = tiny(variant)
    ref = _reference(model)
    body_only = copy.deepcopy(model)
    quantize_linears(body_only)
    ids = prompt(2, 11)
    with torch.no_grad():
        assert not torch.equal(ref(ids).logits, body_only(ids).logits), "the fp8 lm_head changed no logit"
    want = _generate(ref, ids)
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(attention=attention, **FP8_HEAD))
    assert torch.equal(_generate(model, ids), want)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    rep = gemma4opt.report(model, print_table=False)
    assert all(r.complete for r in rep.rows), str(rep)
    assert rep.row("logit_softcap").matched == 1


def test_the_lm_head_is_fp8_and_the_embedding_table_stays():
    model = tiny("tiny", dtype=torch.bfloat16)
    table = model.get_input_embeddings().weight
    bf16_head = model.lm_head.weight.detach().clone()
    assert model.lm_head.weight is table                     # tied, as Gemma-4 is
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(**FP8_HEAD))
    head = model.get_output_embeddings()
    assert isinstance(head, Fp8Linear) and head.weight.dtype == FP8_DTYPE
    q, s = quantize_weight_reference(bf16_head)
    assert torch.equal(head.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(head.weight_scale, s)
    assert model.get_input_embeddings().weight is table and table.dtype == torch.bfloat16
    _generate(model, prompt(1, 5), 2)
    text = str(gemma4opt.report(model, print_table=False))
    assert "gate/up/down, lm_head)" in text and "lm_head's fp8 copy" in text


def test_needs_fp8_quantization():
    with pytest.raises(ValueError, match="quantize_lm_head.*needs quantization='fp8'"):
        gemma4opt.Gemma4OptConfig(quantize_lm_head=True)
    with pytest.raises(TypeError, match="quantize_lm_head"):
        gemma4opt.Gemma4OptConfig(quantization="fp8", quantize_lm_head="yes")


def test_a_head_it_cannot_quantize_is_listed_and_kept():
    model = tiny("tiny")
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    assert quantize_lm_head(model) == {"skipped: lm_head, a linear with a bias": 1}
    assert type(model.lm_head) is torch.nn.Linear


def test_cannot_be_undone_and_survives_to():
    model = tiny("tiny")
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(**FP8_HEAD))
    with pytest.raises(ValueError, match="lm_head was quantized to fp8"):
        gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(quantization="fp8"))
    model.to(torch.float32)                 # optimize() again for the same device: the head stays fp8
    assert isinstance(model.get_output_embeddings(), Fp8Linear)
    _generate(model, prompt(1, 5), 2)
    assert gemma4opt.report(model, print_table=False).row("logit_softcap").matched == 1


@pytest.mark.parametrize("how", ["in place", "new storage"])
@pytest.mark.parametrize("attention", ["hf", "paged"])
def test_an_edited_embedding_table_reaches_the_tied_fp8_head(attention, how):
    """HF's tied lm_head reads the embedding table itself: an edit of the table after optimize()
    gives what the same edit before optimize() gives (runtime/weight_watch.py TiedHeadWatch)."""
    model = tiny("tiny")
    ids = prompt(2, 11)

    def edit(m):
        table = m.get_input_embeddings().weight
        with torch.no_grad():
            if how == "in place":
                table[: table.shape[0] // 2].mul_(-3)
            else:
                table.data = table.data.flip(0).clone()

    before = copy.deepcopy(model)
    edit(before)
    cfg = gemma4opt.Gemma4OptConfig(attention=attention, **FP8_HEAD)
    gemma4opt.optimize(before, cfg)
    gemma4opt.optimize(model, cfg)
    untouched = _generate(model, ids)
    edit(model)
    want = _generate(before, ids)
    assert not torch.equal(want, untouched)
    assert torch.equal(_generate(model, ids), want)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before(ids).logits)
    assert model._gemma4opt.head.requantized == 1
