"""Greedy generate of the optimized model == HF eager, on tiny configs of every Gemma-4 variant."""
import pytest
import torch

import gemma4opt
from tests.models import VARIANTS, WINDOW, prompt, tiny

NEW = 12


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kw)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tokens_equal_eager_below_and_past_window(variant):
    model = tiny(variant)
    short, long = prompt(1, WINDOW - 3), prompt(1, WINDOW + 5, seed=2)
    want = [_generate(model, short), _generate(model, long)]
    gemma4opt.optimize(model)
    got = [_generate(model, short), _generate(model, long)]   # two generate calls in a row
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    rep = gemma4opt.report(model, print_table=False)
    assert all(r.complete for r in rep.rows), str(rep)
    assert rep.fallbacks == {}
    assert rep.graphs_compiled <= 6, f"recompilations not bounded: {rep.graphs_compiled}"


@pytest.mark.parametrize("variant", ["tiny", "tiny-ple-shared"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_batch_left_padding_and_cache_kinds(variant, cache):
    model = tiny(variant)
    ids = prompt(2, WINDOW + 3)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0                       # row 0 is left-padded
    ids[0, :5] = 0
    kw = dict(attention_mask=mask, cache_implementation=cache)
    want = _generate(model, ids, **kw)
    gemma4opt.optimize(model)
    assert torch.equal(_generate(model, ids, **kw), want)


def test_conditional_generation_text_decoder_is_optimized():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from gemma4opt.presets import TINY_PRESETS, randomize_

    torch.manual_seed(0)
    cfg = Gemma4Config(text_config=TINY_PRESETS["tiny"], vision_config=None, audio_config=None)
    model = randomize_(Gemma4ForConditionalGeneration(cfg).eval())
    ids = prompt(1, 10)
    want = _generate(model, ids)
    assert gemma4opt.optimize(model) is model
    assert torch.equal(_generate(model, ids), want)
    rep = gemma4opt.report(model, print_table=False)
    assert rep.scope == "text_model" and rep.compiled_calls > 0
    assert all(r.complete for r in rep.rows), str(rep)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_within_tolerance(dtype):
    model = tiny("tiny-moe", dtype=dtype)
    ids = prompt(2, 11)
    with torch.no_grad():
        want = model(ids).logits.float()
        gemma4opt.optimize(model)
        got = model(ids).logits.float()
    # Stated tolerance for bf16 (fp16 is tighter): |diff| <= 0.05 + 1% of |logit| (softcapped
    # logits are in [-30, 30]).
    torch.testing.assert_close(got, want, rtol=1e-2, atol=5e-2)
    assert gemma4opt.report(model, print_table=False).compiled_calls == 1


def test_inductor_lowering_on_cpu_matches_eager():
    """The CUDA path's lowering (Inductor over the rewritten graph, merged-weight constants,
    static cache) exercised on the CPU: same tokens as eager."""
    from gemma4opt import Gemma4OptConfig

    model = tiny("tiny-moe")
    ids = prompt(2, WINDOW + 2)
    want = _generate(model, ids, cache_implementation="static")
    gemma4opt.optimize(model, Gemma4OptConfig(inductor=True, cache="static"))
    assert torch.equal(_generate(model, ids), want)
    assert all(r.complete for r in gemma4opt.report(model, print_table=False).rows)
