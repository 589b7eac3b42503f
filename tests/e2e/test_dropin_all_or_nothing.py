"""optimize() is all-or-nothing, and a second optimize() re-optimizes only for a new config."""
import pytest
import torch

import gemma4opt
import gemma4opt.api as api
from gemma4opt import Gemma4OptConfig
from tests.models import prompt, tiny

PAGED = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)


def _look(model):
    """What a failed optimize() must leave as it was."""
    return dict(keys=sorted(vars(model)), forward=model.forward, generate=model.generate, config=model.config,
                gen_config=model.generation_config, apply=model._apply,
                modules={n: (type(m), sorted(vars(m)), m.__dict__.get("config")) for n, m in model.named_modules()},
                params={n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()},
                attn=model.config._attn_implementation, gen=model.generation_config.to_dict())


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _boom(*a, **k):
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("fail", [
    pytest.param(dict(patch="install_paged", cfg=PAGED), id="install_paged"),
    pytest.param(dict(patch="_install_generate_checks", cfg=PAGED), id="generate_checks-paged"),
    pytest.param(dict(patch="_install_generate_checks", cfg=None), id="generate_checks-hf"),
    pytest.param(dict(patch="install_deferred_stop_check", cfg=Gemma4OptConfig(deferred_stop=True)),
                 id="stop_check"),
    pytest.param(dict(patch=None, cfg=Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96,
                                                      max_batch_size=4, kv_pool_fraction=1e-9)),
                 id="kv_pool_fraction-too-small"),
])
def test_failure_inside_optimize_leaves_the_model_as_it_was(monkeypatch, fail):
    model = tiny()
    ids = prompt(1, 6)
    want = _logits(model, ids)
    before = _look(model)
    if fail["patch"]:
        monkeypatch.setattr(api, fail["patch"], _boom)
    else:   # the CPU pool is not sized from free memory: stand in a device with 1 MiB free
        import gemma4opt.paged.step as context

        monkeypatch.setattr(context, "free_device_memory", lambda device: 1 << 20)
    with pytest.raises((RuntimeError, ValueError), match="injected failure|kv_pool_fraction"):
        gemma4opt.optimize(model, fail["cfg"])
    assert not hasattr(model, "_gemma4opt")
    assert _look(model) == before
    assert torch.equal(_logits(model, ids), want)
    if fail["patch"] == "install_paged":
        monkeypatch.undo()
        gemma4opt.optimize(model)                         # and it can still be optimized
        assert torch.equal(_logits(model, ids), want)


def test_reoptimize_with_another_config_warns_and_takes_effect():
    model = gemma4opt.optimize(tiny())
    ids = prompt(1, 6)
    want = _logits(model, ids)
    state = model._gemma4opt
    assert gemma4opt.report(model, print_table=False).rows
    with pytest.warns(UserWarning, match="re-optimizing"):
        assert gemma4opt.optimize(model, Gemma4OptConfig(patterns=())) is model
    assert model._gemma4opt is not state and model._gemma4opt.user_config == Gemma4OptConfig(patterns=())
    assert torch.equal(_logits(model, ids), want)
    rep = gemma4opt.report(model, print_table=False)
    assert rep.rows == [] and rep.compiled_calls == 1

    state = model._gemma4opt
    forward, generate = model.forward, model.generate
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # same config / None: as is, silently
        assert gemma4opt.optimize(model, Gemma4OptConfig(patterns=())) is model
        assert gemma4opt.optimize(model) is model
    assert model._gemma4opt is state and model.forward is forward and model.generate is generate

    with pytest.warns(UserWarning, match="re-optimizing"):
        gemma4opt.optimize(model, PAGED)
    assert model._gemma4opt.config.attention == "paged" and model._gemma4opt.context is not None
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, tiny().generate(ids, max_new_tokens=3, do_sample=False))
