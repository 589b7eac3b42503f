"""Submodules replaced after optimize() (runtime/module_watch.py): the model is optimized again
for them, in every mode, with HF's tokens and logits; the caller's config edits made after
optimize() survive that, and a move's re-optimization too."""
import copy

import pytest
import torch

import gemma4opt
from tests.models import prompt, tiny
from tests.runtime.test_weight_watch import _optimize, assert_forward_sees


def _run(model, ids, **kw):
    kw = dict(dict(max_new_tokens=8, min_new_tokens=8, do_sample=False), **kw)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **kw)


class Doubled(torch.nn.Module):
    """A wrapper around a projection of another type (as LoRA's are): its forward changes the output."""

    def __init__(self, inner):
        super().__init__()
        self.base_layer = inner

    def forward(self, x):
        return 2 * self.base_layer(x)


def _swap_linear(m, src):
    m.model.layers[1].mlp.up_proj = copy.deepcopy(src.model.layers[1].mlp.up_proj)


def _swap_mlp(m, src):
    m.model.layers[0].mlp = copy.deepcopy(src.model.layers[0].mlp)


def _swap_attention(m, src):
    m.model.layers[1].self_attn = copy.deepcopy(src.model.layers[1].self_attn)


def _wrap_up_proj(m, src):
    mlp = m.model.layers[0].mlp
    mlp.up_proj = Doubled(mlp.up_proj)


SWAPS = {"linear": _swap_linear, "mlp": _swap_mlp, "attention": _swap_attention, "wrapper": _wrap_up_proj}


@pytest.mark.parametrize("mode", ["hf", "paged"])
@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_a_replaced_module_gives_hfs_tokens(monkeypatch, mode, swap):
    ref, other = tiny(), tiny(seed=5)
    model = copy.deepcopy(ref)
    ids = prompt(1, 6)
    _optimize(monkeypatch, model, mode)
    assert torch.equal(_run(model, ids), _run(ref, ids))
    for m in (ref, model):
        SWAPS[swap](m, other)
    want = _run(ref, ids)
    assert not torch.equal(want, _run(tiny(), ids))          # the swap changes the tokens
    with pytest.warns(UserWarning, match="replaced after optimize"):
        assert torch.equal(_run(model, ids), want)
    assert torch.equal(_run(model, ids), want)               # and again, without optimizing again
    assert model._gemma4opt.modules.replaced() == []


def test_a_forward_outside_generate_sees_a_replaced_module():
    other = tiny(seed=5)
    assert_forward_sees(lambda m: _swap_linear(m, other),
                        expect=pytest.warns(UserWarning, match=r"model\.layers\.1\.mlp\.up_proj replaced after optimize"))


@pytest.mark.parametrize("how", ["replaced module", "unsupported move"])
def test_config_edits_after_optimize_survive_optimizing_again(how):
    """Optimizing again (a replaced module, a move) keeps the caller's edits to the model's config
    and generation config since optimize(), and makes optimize()'s own settings anew; a move to a
    dtype gemma4opt does not run leaves HF's forward with those edits."""
    ref, other = tiny(), tiny(seed=5)
    model = copy.deepcopy(ref)
    gemma4opt.optimize(model)
    ids = prompt(1, 12)
    for m in (ref, model):
        m.generation_config.max_new_tokens = 3
        m.config.sliding_window = 4
    with pytest.warns(UserWarning, match="replaced after optimize" if how == "replaced module" else
                      "could not be optimized again"):
        for m in (ref, model):
            if how == "replaced module":
                _swap_linear(m, other)
            else:
                m.to(torch.float64)
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)
            got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)
    assert want.shape[1] == 12 + 3 and torch.equal(got, want)
    assert model.config.sliding_window == 4 and model.generation_config.max_new_tokens == 3
    assert hasattr(model, "_gemma4opt") == (how == "replaced module")
