"""Module hooks added after optimize() run, as they would without gemma4opt (runtime/hook_watch.py):
calls made while the hooks differ from optimize()'s run HF's forward, counted in the report."""
import pytest
import torch

import gemma4opt
from tests.models import prompt, tiny
from tests.runtime.test_paged_graphs import _optimize_with_stand_ins


def _run(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                              do_sample=False)


def _flip(module, args, out):
    return -out


def _hook_fallbacks(model) -> int:
    return sum(v for k, v in model._gemma4opt.fallbacks.items() if k.startswith("module hooks changed"))


@pytest.mark.parametrize("mode", ["hf", "paged"])
def test_a_hook_added_after_optimize_runs_and_its_removal_is_seen(monkeypatch, mode):
    model = tiny()
    ids = prompt(1, 6)
    before = _run(model, ids)
    handle = model.model.norm.register_forward_hook(_flip)
    hooked = _run(model, ids)
    handle.remove()
    assert not torch.equal(before, hooked)
    if mode == "paged":
        _optimize_with_stand_ins(monkeypatch, model)
    else:
        gemma4opt.optimize(model)
    assert torch.equal(_run(model, ids), before)
    handle = model.model.norm.register_forward_hook(_flip)
    with pytest.warns(UserWarning, match="module hooks changed after optimize"):
        assert torch.equal(_run(model, ids), hooked)
    assert _hook_fallbacks(model) > 0
    assert "model.norm forward hooks" in str(gemma4opt.report(model, print_table=False))
    handle.remove()
    n, calls = _hook_fallbacks(model), model._gemma4opt.compiled_calls
    assert torch.equal(_run(model, ids), before)
    assert _hook_fallbacks(model) == n and model._gemma4opt.compiled_calls > calls


def test_hooks_present_at_optimize_are_traced_and_hfs_own_capture_hooks_do_not_count():
    model = tiny()
    ids = prompt(1, 6)
    model.model.norm.register_forward_hook(_flip)
    want = _run(model, ids)
    gemma4opt.optimize(model)
    assert torch.equal(_run(model, ids), want)
    with torch.no_grad():
        model(ids, output_hidden_states=True)        # HF installs its (inert) capture hooks: a fallback call
    assert torch.equal(_run(model, ids), want)
    assert _hook_fallbacks(model) == 0, model._gemma4opt.fallbacks


def test_a_global_module_hook_counts():
    model = tiny()
    ids = prompt(1, 6)
    gemma4opt.optimize(model)
    want = _run(model, ids)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    try:
        with pytest.warns(UserWarning, match="every module"):
            assert torch.equal(_run(model, ids), want)
    finally:
        handle.remove()
    assert "Gemma4TextDecoderLayer" in seen
