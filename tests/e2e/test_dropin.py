"""The optimized model is a drop-in for HF's: every call gives what the same model gave before
optimize() (a copy.deepcopy taken then), in both attention modes.

Exactness on the CPU in float32: prefill (and any call without a cache) is bit-identical; a decode
step on the caller's own DynamicCache differs by ~4e-7 in the logits, because HF's forward under
Dynamo differs from HF eager there (plain ``torch.compile(model.forward, backend="eager")`` gives the
same difference), so those compare with atol 2e-6. Tokens are always compared exactly."""
import copy
import json
import os
import tempfile
import warnings

import pytest
import torch
from transformers import CompileConfig, DynamicCache, Gemma4ForCausalLM

import gemma4opt
from gemma4opt import Gemma4OptConfig
from gemma4opt.presets import build_model
from tests.models import VARIANTS, WINDOW, prompt, tiny

PAGED = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)
MODES = {"hf": None, "paged": PAGED}
DECODE_ATOL = 2e-6

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _inputs():
    """Left padding; row 0 holds fewer tokens than the window, row 1 more."""
    ids = prompt(2, WINDOW + 4)
    mask = torch.ones_like(ids)
    mask[0, :WINDOW - 2] = 0
    return ids, mask


_PAIRS = {}


def pair(variant="tiny", mode="hf"):
    """(optimized, HF copy) per variant and mode, shared by the tests of this module."""
    key = (variant, mode)
    if key not in _PAIRS:
        model = tiny(variant)
        ref = copy.deepcopy(model)
        _PAIRS[key] = gemma4opt.optimize(model, MODES[mode]), ref
    return _PAIRS[key]


def _gen(model, ids, mask, seed=None, **kw):
    if seed is not None:
        torch.manual_seed(seed)
    kw.setdefault("max_new_tokens", 4)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_and_generate_equal_hf(variant, mode):
    model, ref = pair(variant, mode)
    ids, mask = _inputs()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
    assert torch.equal(_gen(model, ids, mask, do_sample=False), _gen(ref, ids, mask, do_sample=False))
    assert torch.equal(_gen(model, ids, mask, 7, do_sample=True), _gen(ref, ids, mask, 7, do_sample=True))
    assert gemma4opt.report(model, print_table=False).compiled_calls > 0


@pytest.mark.parametrize("mode", MODES)
def test_fallback_features_equal_hf(mode):
    model, ref = pair("tiny", mode)
    ids, mask = _inputs()
    kw = dict(attention_mask=mask, labels=ids, output_hidden_states=True)
    with torch.no_grad():
        got, want = model(ids, **kw), ref(ids, **kw)
        assert torch.equal(got.loss, want.loss) and torch.equal(got.logits, want.logits)
        assert len(got.hidden_states) == len(want.hidden_states)
        assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
        got, want = model(ids, attention_mask=mask, output_attentions=True), ref(ids, attention_mask=mask,
                                                                                  output_attentions=True)
        assert got.attentions is not None and len(got.attentions) == len(want.attentions)
        assert all(torch.equal(a, b) for a, b in zip(got.attentions, want.attentions))


@pytest.mark.parametrize("mode", MODES)
def test_train_mode_loss_and_grads_equal_hf(mode):
    model, ref = pair("tiny", mode)
    ids, mask = _inputs()
    try:
        for m in (model, ref):
            m.train()
            m.zero_grad(set_to_none=True)
        got, want = model(ids, attention_mask=mask, labels=ids), ref(ids, attention_mask=mask, labels=ids)
        assert torch.equal(got.loss, want.loss)
        got.loss.backward()
        want.loss.backward()
        grads = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())]
        assert all(g is not None for _, g, _ in grads)
        assert [n for n, a, b in grads if not torch.equal(a, b)] == []
    finally:
        for m in (model, ref):
            m.eval()
            m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", MODES)
def test_beam_search_equals_hf(mode):
    model, ref = pair("tiny", mode)
    ids, mask = _inputs()
    kw = dict(num_beams=2, do_sample=False, return_dict_in_generate=True, output_scores=True, max_new_tokens=2)
    got, want = _gen(model, ids, mask, **kw), _gen(ref, ids, mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=DECODE_ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_callers_own_cache(mode):
    model, ref = pair("tiny", mode)
    ids, mask = _inputs()
    caches = DynamicCache(config=model.config), DynamicCache(config=ref.config)
    with torch.no_grad():
        outs = [m(ids, attention_mask=mask, past_key_values=c, use_cache=True) for m, c in zip((model, ref), caches)]
        assert torch.equal(outs[0].logits, outs[1].logits)
        assert outs[0].past_key_values is caches[0]
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        nxt = outs[1].logits[:, -1:].argmax(-1)
        mask2 = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        outs = [m(nxt, attention_mask=mask2, past_key_values=c) for m, c in zip((model, ref), caches)]
        torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=0, atol=DECODE_ATOL)
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == ids.shape[1] + 1
    # generate continuing from the caller's (prefilled) cache
    cont = torch.cat([ids, nxt], 1)
    got = _gen(model, cont, mask2, past_key_values=caches[0], do_sample=False, max_new_tokens=2)
    want = _gen(ref, cont, mask2, past_key_values=caches[1], do_sample=False, max_new_tokens=2)
    assert torch.equal(got, want)


def test_presets_build_sdpa_and_eager_models_work_too():
    assert tiny().config._attn_implementation == "sdpa"
    model = build_model("tiny", attn_implementation="eager")
    ref = copy.deepcopy(model)
    gemma4opt.optimize(model)
    assert model.config._attn_implementation == "eager"
    ids, mask = _inputs()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
        got, want = model(ids, output_attentions=True), ref(ids, output_attentions=True)
        assert all(torch.equal(a, b) for a, b in zip(got.attentions, want.attentions))
    assert torch.equal(_gen(model, ids, mask, do_sample=False), _gen(ref, ids, mask, do_sample=False))


def _q_k_share_storage(model):
    attn = model.model.layers[0].self_attn
    return attn.q_proj.weight.untyped_storage().data_ptr() == attn.k_proj.weight.untyped_storage().data_ptr()


_MOVES = {"hf": [(lambda m: m.bfloat16(), torch.bfloat16), (lambda m: m.half(), torch.float16)],
          "paged": [(lambda m: m.to(torch.bfloat16), torch.bfloat16)]}


@pytest.mark.parametrize("mode", MODES)
def test_moves_after_optimize(mode):
    model = gemma4opt.optimize(tiny(), MODES[mode])
    ref = tiny()
    assert _q_k_share_storage(model) and not _q_k_share_storage(ref)
    ids, mask = _inputs()
    state = model._gemma4opt
    model.to(device="cpu")                                   # nothing moves: nothing is redone
    assert model._gemma4opt is state
    for move, dtype in _MOVES[mode]:
        assert move(model) is model
        move(ref)
        assert model.lm_head.weight.dtype == dtype and model._gemma4opt is not state
        state = model._gemma4opt
        assert state.config.attention == mode
        assert _q_k_share_storage(model)                     # merged weights are still views of one tensor
        assert torch.equal(_gen(model, ids, mask, do_sample=False, max_new_tokens=2),
                           _gen(ref, ids, mask, do_sample=False, max_new_tokens=2))
    assert {n: p.dtype for n, p in model.named_parameters()} == {n: p.dtype for n, p in ref.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_save_pretrained_round_trip(mode):
    model, ref = pair("tiny", mode)
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as hf:
        model.save_pretrained(d)
        ref.save_pretrained(hf)
        # The same files as HF's: no field optimize() set for this instance (disable_compile) saved.
        for name in ("config.json", "generation_config.json"):
            with open(os.path.join(d, name)) as got, open(os.path.join(hf, name)) as want:
                assert json.load(got) == json.load(want), name
        loaded = Gemma4ForCausalLM.from_pretrained(d)
    assert model.generation_config.disable_compile      # still the optimized model's own, after the save
    want, got = ref.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert not hasattr(loaded, "_gemma4opt") and loaded.config._attn_implementation == ref.config._attn_implementation


def test_compile_config_warns_once_that_it_is_ignored():
    model, ref = pair("tiny", "hf")
    ids, mask = _inputs()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            got = _gen(model, ids, mask, do_sample=False, compile_config=CompileConfig())
    assert len([w for w in seen if "compile_config is ignored" in str(w.message)]) == 1
    assert torch.equal(got, _gen(ref, ids, mask, do_sample=False))


@pytest.mark.parametrize("mode", MODES)
def test_empty_prompt_is_a_plain_value_error(mode):
    model, _ = pair("tiny", mode)
    empty = torch.zeros((2, 0), dtype=torch.long)
    with torch.no_grad():
        with pytest.raises(ValueError, match="gemma4opt: the input has no tokens"):
            model(empty)
        with pytest.raises(ValueError, match="gemma4opt: the input has no tokens"):
            model.generate(empty, max_new_tokens=2)
        with pytest.raises(ValueError, match="gemma4opt: the input has no tokens"):
            model.generate(input_ids=empty, max_new_tokens=2)
