"""Merged projection weights given new storage after optimize() reach the graphs
(runtime/weight_watch.py): tokens and logits equal HF's with the same change, in every mode."""
import contextlib
import copy

import pytest
import torch

import gemma4opt
from gemma4opt.patterns.merged_projections import MERGED_ATTR
from tests.models import VARIANTS, prompt, tiny
from tests.runtime.test_paged_graphs import _optimize_with_stand_ins


def _run(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                              do_sample=False)


def _new(w, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(w.shape, generator=g, dtype=w.dtype) * 0.5


def _replace_data(model):
    lin = model.model.layers[1].self_attn.q_proj
    lin.weight.data = _new(lin.weight, 1)


def _replace_parameter(model):
    lin = model.model.layers[0].mlp.up_proj
    lin.weight = torch.nn.Parameter(_new(lin.weight, 2))


def _load_assign(model):
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for k in sd:
        if k.endswith(("k_proj.weight", "gate_proj.weight")):
            sd[k] = _new(sd[k], 3)
    model.load_state_dict(sd, assign=True)


def _swap_gate_up(model):
    # both sources are views of the merged weight: each must be read before either is overwritten
    mlp = model.model.layers[1].mlp
    mlp.gate_proj.weight.data, mlp.up_proj.weight.data = mlp.up_proj.weight.data, mlp.gate_proj.weight.data


def _replace_norm(model):
    # not merged: a graph input, read each call; decode graphs check its address (runtime/decode_graphs.py)
    norm = model.model.layers[1].post_attention_layernorm
    norm.weight.data = _new(norm.weight, 4) + 1


EDITS = {"data": _replace_data, "parameter": _replace_parameter, "load_state_dict_assign": _load_assign,
         "swap": _swap_gate_up, "norm": _replace_norm}


def _optimize(monkeypatch, model, mode):
    if mode == "paged":
        _optimize_with_stand_ins(monkeypatch, model)
    else:
        gemma4opt.optimize(model)


@pytest.mark.parametrize("mode", ["hf", "paged"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_replaced_weights_give_hfs_tokens(monkeypatch, mode, edit):
    ref = tiny()
    model = copy.deepcopy(ref)
    ids = prompt(1, 6)
    _optimize(monkeypatch, model, mode)
    assert torch.equal(_run(model, ids), _run(ref, ids))
    for m in (ref, model):
        EDITS[edit](m)
    want = _run(ref, ids)
    assert not torch.equal(want, _run(tiny(), ids))          # the edit changes the tokens
    assert torch.equal(_run(model, ids), want)
    assert torch.equal(_run(model, ids), want)               # and again: nothing left to restore
    rep = gemma4opt.report(model, print_table=False)
    assert bool(rep.weights_restored) == (edit != "norm")
    assert ("copied into the merged weights" in str(rep)) == (edit != "norm")


def assert_forward_sees(edit, variant="tiny", expect=None):
    """A forward outside generate after ``edit`` (made on the optimized model and an HF copy) gives
    HF's logits; ``expect``: the context the edited call runs in (a pytest.warns)."""
    ref = tiny(variant)
    model = copy.deepcopy(ref)
    gemma4opt.optimize(model)
    ids = prompt(2, 7)
    with torch.no_grad():
        model(ids)
        for m in (ref, model):
            edit(m)
        with expect or contextlib.nullcontext():
            got = model(ids).logits
        torch.testing.assert_close(got, ref(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_forward_outside_generate_sees_a_replaced_weight(variant):
    assert_forward_sees(_replace_data, variant)


def test_the_callers_parameter_stays_the_models_and_a_view_of_the_merged_weight():
    model = tiny()
    gemma4opt.optimize(model)
    attn = model.model.layers[1].self_attn
    held = attn.q_proj.weight
    merged = getattr(attn, MERGED_ATTR)
    new = _new(held, 1)
    held.data = new.clone()
    _run(model, prompt(1, 5))
    assert attn.q_proj.weight is held
    assert held.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    assert torch.equal(held, new) and torch.equal(merged[:held.shape[0]], new)
    with torch.no_grad():
        held.mul_(2)                           # in-place edits write through the view again
    assert torch.equal(merged[:held.shape[0]], 2 * new)


@pytest.mark.parametrize("change", ["dtype", "rows"])
def test_a_weight_of_another_shape_or_dtype_is_a_clear_error(change):
    model = tiny()
    gemma4opt.optimize(model)
    lin = model.model.layers[0].self_attn.q_proj          # the first rows: fewer of them fit the merged slice
    lin.weight.data = lin.weight.data.double() if change == "dtype" else lin.weight.data[:8].clone()
    want = "torch.float64" if change == "dtype" else r"shape \(8, "
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight was replaced after "
                                           rf"optimize\(\).*{want}.*same shape, dtype and device"):
        _run(model, prompt(1, 5))
