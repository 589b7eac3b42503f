"""attention="paged" with HF generate's features: a returned cache continued, inputs_embeds,
position_ids, cache_implementation, outputs that need HF's forward, assisted decoding, limits.
Every case compares with HF eager on a copy taken before optimize (tokens equal; scores,
logits and attentions equal in shape and, within a tolerance, in value)."""
import contextlib
import copy
import gc
import warnings

import numpy as np
import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from gemma4opt.paged.cache import PagedCache
from tests.models import VARIANTS, WINDOW, prompt, tiny

PAGED = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)
_MODELS = {}


def _pair(variant):
    """(HF eager reference, optimized paged model) per variant, built once for this module."""
    if variant not in _MODELS:
        model = tiny(variant)
        model.set_attn_implementation("eager")      # HF's attentions are eager-only
        ref = copy.deepcopy(model)
        gemma4opt.optimize(model, PAGED)
        _MODELS[variant] = (ref, model)
    return _MODELS[variant]


@pytest.fixture(autouse=True)
def _pages_come_back():
    yield
    gc.collect()
    for _, model in _MODELS.values():
        ctx = model._gemma4opt.context
        ctx.free_collected()
        assert ctx.row_free.all(), "rows still held after the test"
        assert all(s.pages_held() == 0 for s in ctx.seqs.values()), "pages still held after the test"


def _padded(batch, length, seed):
    ids = prompt(batch, length, seed=seed)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, : length // 3] = 0
        ids[1, : length // 3] = 0
    return ids, mask


def _gen(model, *args, new=5, **kw):
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(*args, max_new_tokens=new, **kw)


def _extend(mask, n):
    return torch.cat([mask, torch.ones(mask.shape[0], n, dtype=mask.dtype)], 1)


def _held(model):
    ctx = model._gemma4opt.context
    ctx.free_collected()               # what the next step or report does first
    return sum(s.pages_held() for s in ctx.seqs.values()), int((~ctx.row_free).sum())


def _conversation(model, ids, mask, crop_last=False):
    """Three turns on one cache: generate, add user tokens, continue, add more, continue."""
    kw = {}
    if crop_last and not hasattr(model, "_gemma4opt"):     # HF's sliding layers crop only what they recorded
        from transformers import DynamicCache

        kw["cache"] = DynamicCache(config=model.config)
        kw["cache"].activate_past_recording()
    out = _gen(model, ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    seqs, cache = out.sequences, out.cache
    if crop_last:                       # as HF's deferred stop check undoes one extra step
        cache.crop(-1)
    turns = [seqs]
    for turn in range(2):
        user = prompt(ids.shape[0], 3 + turn, seed=10 + turn)
        longer = torch.cat([seqs, user], 1)
        mask = _extend(mask, longer.shape[1] - mask.shape[1])
        kw = {"past_key_values": cache} if turn == 0 else {"cache": cache}
        out = _gen(model, longer, attention_mask=mask, return_dict_in_generate=True, **kw)
        assert out.cache is cache
        seqs = out.sequences
        turns.append(seqs)
    return turns, cache


# Every variant past the window; below it on one (compiles dominate this file's time on a CPU).
@pytest.mark.parametrize("variant,length", [(v, 2 * WINDOW + 1) for v in VARIANTS] + [("tiny", WINDOW - 3)])
def test_returned_cache_continues_the_conversation(variant, length):
    ref, model = _pair(variant)
    ids, mask = _padded(2, length, seed=length)
    want, _ = _conversation(ref, ids, mask)
    got, cache = _conversation(model, ids, mask)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert isinstance(cache, PagedCache) and _held(model)[0] > 0 and _held(model)[1] == 2
    del cache
    gc.collect()                        # dropped: pages and rows go back
    assert _held(model) == (0, 0)


def test_a_cache_collected_mid_trace_is_freed_before_the_next_page_work():
    """The garbage collector may drop a returned cache while anything runs, a Dynamo trace under
    fake tensors included: its rows are only queued then, and freed before the next step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ref, model = _pair("tiny")
    ids, mask = _padded(2, 7, seed=1)
    out = _gen(model, ids, attention_mask=mask, return_dict_in_generate=True)
    cache = out.cache
    del out
    ctx = model._gemma4opt.context
    with FakeTensorMode():
        del cache
        gc.collect()
    assert ctx.collected and not ctx.row_free.all()       # queued, nothing touched yet
    want = _gen(ref, ids, attention_mask=mask)
    assert torch.equal(_gen(model, ids, attention_mask=mask), want)
    assert not ctx.collected and ctx.row_free.all()


@pytest.mark.parametrize("variant", ["tiny-ple-shared"])
def test_crop_then_continue_and_several_live_caches(variant):
    """crop(-1) (the deferred stop check's undo) really drops the token; two returned caches
    live side by side on their own rows; release()/reset() give the pages back."""
    ref, model = _pair(variant)
    ids, mask = _padded(2, WINDOW + 5, seed=3)
    want, _ = _conversation(ref, ids, mask, crop_last=True)
    other = _gen(model, prompt(1, 6, seed=4), return_dict_in_generate=True).cache     # holds row 0
    got, cache = _conversation(model, ids, mask, crop_last=True)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert sorted(np.concatenate([other.rows, cache.rows]).tolist()) == [0, 1, 2]
    with pytest.raises(ValueError, match="max_batch_size=4"):      # 3 rows held, 2 asked
        _gen(model, ids, attention_mask=mask)
    assert _held(model)[1] == 3
    other.release()
    cache.reset()
    assert _held(model) == (0, 0) and cache.get_seq_length() == 0
    # A released cache starts again from nothing: HF then runs the whole prompt.
    assert torch.equal(_gen(model, ids, attention_mask=mask, cache=cache), _gen(ref, ids, attention_mask=mask))
    cache.release()


def test_crop_takes_the_count_as_a_tensor():
    """transformers' assisted decoding passes crop() a 0-d tensor (seen on the GPU machine's 5.17)."""
    from gemma4opt.paged.install import _returned_cache

    _, model = _pair("tiny")
    cache = _returned_cache(_gen(model, prompt(1, 6, seed=5), return_dict_in_generate=True))
    n = cache.get_seq_length()
    cache.crop(torch.tensor(-2))
    assert cache.get_seq_length() == n - 2
    assert model._gemma4opt.context.seqs["full_attention"].seq_len[cache.rows].tolist() == [n - 2]
    cache.release()


def test_crop_shrinks_paged_sequences():
    from gemma4opt.paged.tables import PagedSequences, PagePool

    ps = 4
    for window in (None, WINDOW):
        a = PagedSequences(PagePool(64, ps), 3, 96, window)
        b = PagedSequences(PagePool(64, ps), 3, 96, window)
        rows = np.array([0, 2])
        a.step(rows, np.array([9, 6]))
        b.step(rows, np.array([9, 6]))
        a.step(rows, np.array([4, 4]))              # a 4-token draft...
        a.crop(rows, 3)                             # ...3 of them rejected
        b.step(rows, np.array([1, 1]))
        assert np.array_equal(a.seq_len, b.seq_len) and np.array_equal(a.count, b.count)
        assert a.pool.free_pages == b.pool.free_pages
        ma, mb = a.step(rows, np.array([2, 2])), b.step(rows, np.array([2, 2]))
        assert np.array_equal(ma.seq_lens, mb.seq_lens) and np.array_equal(ma.kv_last_page_len, mb.kv_last_page_len)
        assert np.array_equal(ma.slot_mapping % ps, mb.slot_mapping % ps)
        with pytest.raises(ValueError, match="cannot drop"):
            a.crop(rows, 20)
        a.release(rows)
        assert a.pool.free_pages == 64


@pytest.mark.parametrize("variant", VARIANTS)
def test_inputs_embeds_and_continuing_from_them(variant):
    ref, model = _pair(variant)
    ids, mask = _padded(2, WINDOW + 3, seed=5)
    embed = ref.get_input_embeddings()
    results = []
    for m in (ref, model):
        with torch.no_grad():
            out = _gen(m, inputs_embeds=embed(ids), attention_mask=mask, return_dict_in_generate=True)
            full = torch.cat([ids, out.sequences], 1)           # HF returns only the new tokens
            more = torch.cat([full, prompt(2, 3, seed=6)], 1)
            again = _gen(m, inputs_embeds=embed(more), attention_mask=_extend(mask, more.shape[1] - mask.shape[1]),
                         cache=out.cache)
        results.append((out.sequences, again))
        del out
    assert all(torch.equal(w, g) for w, g in zip(*results))


@pytest.mark.parametrize("variant", ["tiny-k-eq-v"])
def test_position_ids_given_or_not(variant):
    ref, model = _pair(variant)
    ids, mask = _padded(2, WINDOW + 2, seed=7)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    want = _gen(ref, ids, attention_mask=mask)
    assert torch.equal(_gen(ref, ids, attention_mask=mask, position_ids=pos), want)
    assert torch.equal(_gen(model, ids, attention_mask=mask, position_ids=pos), want)
    ids1 = prompt(2, WINDOW + 2, seed=8)
    pos1 = torch.arange(ids1.shape[1])[None].expand(2, -1)
    assert torch.equal(_gen(model, ids1, position_ids=pos1), _gen(ref, ids1))


@pytest.mark.parametrize("variant", ["tiny-moe"])
def test_static_cache_implementation_is_honoured(variant):
    ref, model = _pair(variant)
    ids, mask = _padded(2, WINDOW + 4, seed=9)
    want = _gen(ref, ids, attention_mask=mask, cache_implementation="static")
    _gen(model, ids, attention_mask=mask)                          # an earlier paged call
    calls = model._gemma4opt.compiled_calls
    assert torch.equal(_gen(model, ids, attention_mask=mask, cache_implementation="static"), want)
    assert model._gemma4opt.compiled_calls > calls


def _close(a, b, what):
    assert a.shape == b.shape, what
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=what)


@pytest.mark.parametrize("variant", VARIANTS)
def test_scores_logits_attentions_hidden_states_equal_hf(variant):
    ref, model = _pair(variant)
    ids, mask = _padded(2, WINDOW + 1, seed=11)
    kw = dict(attention_mask=mask, return_dict_in_generate=True, output_scores=True, output_logits=True, new=4)
    for extra in ({}, {"output_attentions": True, "output_hidden_states": True}):
        want, got = _gen(ref, ids, **kw, **extra), _gen(model, ids, **kw, **extra)
        assert torch.equal(want.sequences, got.sequences), extra
        for name in ("scores", "logits", "attentions", "hidden_states"):
            w, g = getattr(want, name, None), getattr(got, name, None)
            assert (w is None) == (g is None), name
            if w is None:
                continue
            assert len(w) == len(g), name
            for step, (ws, gs) in enumerate(zip(w, g)):
                for layer, (a, b) in enumerate(zip(ws, gs) if isinstance(ws, tuple) else [(ws, gs)]):
                    _close(a, b, f"{name}[{step}][{layer}]")
        paged = extra == {}
        assert isinstance(got.cache, PagedCache) == paged
        del want, got


@pytest.mark.parametrize("variant", ["tiny", "tiny-ple-shared"])
def test_sampling_same_seed_same_tokens(variant):
    ref, model = _pair(variant)
    ids, mask = _padded(2, WINDOW + 2, seed=12)
    res = []
    for m in (ref, model):
        torch.manual_seed(7)
        res.append(_gen(m, ids, attention_mask=mask, do_sample=True, top_k=20, new=6))
    assert torch.equal(*res)


def _assist_outputs(m, ids, **kw):
    out = _gen(m, ids, new=8, return_dict_in_generate=True, **kw)
    return out.sequences, out


# KV-shared variants verify a draft with logits_to_keep = draft + 1, which slices the KV-shared
# layers' inputs: the passes place their replacements by dataflow (compiler.regions.place).
_ASSISTED = [(v, "lookup") for v in VARIANTS] + [("tiny-moe", "assistant"), ("tiny", "optimized_assistant")]


@pytest.mark.parametrize("variant,how", _ASSISTED)
def test_assisted_decoding(variant, how):
    ref, model = _pair(variant)
    # Repeats give prompt lookup something to find; past the window so crops cross pages.
    ids = torch.cat([prompt(1, WINDOW + 2, seed=13)] * 2, 1)
    greedy = _gen(ref, ids, new=8)
    if how == "lookup":
        kw = {"prompt_lookup_num_tokens": 3}
    else:
        assistant = tiny(variant, seed=3) if how == "assistant" else _pair(VARIANTS[(VARIANTS.index(variant) + 1)
                                                                                   % len(VARIANTS)])[1]
        kw = {"assistant_model": assistant}
    for extra in ({}, {"output_scores": True, "output_logits": True}, {"output_attentions": True}):
        want, wout = _assist_outputs(ref, ids, **kw, **extra)
        got, gout = _assist_outputs(model, ids, **kw, **extra)
        assert torch.equal(want, greedy) and torch.equal(got, want), extra
        assert isinstance(gout.cache, PagedCache) == ("output_attentions" not in extra)
        for name in ("scores", "logits", "attentions"):
            w, g = getattr(wout, name, None), getattr(gout, name, None)
            assert (w is None) == (g is None), name
            if w is not None:
                assert len(w) == len(g), name
                for step, (ws, gs) in enumerate(zip(w, g)):
                    for layer, (a, b) in enumerate(zip(ws, gs) if isinstance(ws, tuple) else [(ws, gs)]):
                        _close(a, b, f"{name}[{step}][{layer}]")
        del wout, gout


def test_too_long_or_too_large_is_refused_before_the_first_token():
    _, model = _pair("tiny")
    st = model._gemma4opt
    calls = st.compiled_calls
    with pytest.raises(ValueError, match=r"90 prompt tokens \+ max_new_tokens=10 = 100 tokens exceeds "
                                         r"Gemma4OptConfig.max_seq_len=96"):
        _gen(model, prompt(1, 90), new=10)
    with pytest.raises(ValueError, match=r"max_length=100 = 100 tokens exceeds Gemma4OptConfig.max_seq_len=96"):
        with torch.no_grad():
            model.generate(prompt(1, 20), max_length=100, do_sample=False)
    with pytest.raises(ValueError, match="batch of 5 sequences exceeds Gemma4OptConfig.max_batch_size=4"):
        _gen(model, prompt(5, 6))
    with pytest.raises(ValueError, match="batch of 6 sequences exceeds Gemma4OptConfig.max_batch_size=4"):
        _gen(model, prompt(2, 6), do_sample=True, num_return_sequences=3)
    out = _gen(model, prompt(1, 80), new=4, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="max_seq_len=96"):       # a continuation counts the whole sequence
        _gen(model, torch.cat([out.sequences, prompt(1, 8)], 1), new=8, cache=out.cache)
    assert st.compiled_calls == calls + 4          # the one generate that ran: prefill + 3 decode steps
    del out


def test_recording_rows_keep_the_window_a_crop_needs():
    """A cache recording its past (HF's activate_past_recording: assisted drafts) keeps a margin of
    sliding pages past the window, so cropping a whole draft leaves every page the new end's window
    sees; without it the same crop is refused, never wrong."""
    from gemma4opt.paged.tables import PagedSequences, PagePool
    from gemma4opt.paged.step import RECORD_MARGIN

    ps = 4
    for margin in (RECORD_MARGIN, 0):
        seqs = PagedSequences(PagePool(256, ps), 2, 200, WINDOW)
        rows = np.array([1])
        seqs.margin[rows] = margin
        seqs.step(rows, np.array([20]))
        for _ in range(9):
            seqs.step(rows, np.array([1]), decode=True)
        if margin:
            seqs.crop(rows, 9)
            assert seqs.seq_len[1] == 20
            first_needed = (20 - (WINDOW - 1)) // ps
            assert seqs.first[1] <= first_needed
        else:
            with pytest.raises(ValueError, match="cannot drop 9 tokens"):
                seqs.crop(rows, 9)


def test_a_changed_sliding_window_runs_hfs_path_and_a_cache_made_before_is_refused():
    """HF reads the config's sliding_window at each call (its masks, its new cache); the paged pool
    was built for the value at optimize(): a changed one runs HF's cache and attention (counted),
    with HF's tokens, and a paged cache made before the change is refused, not continued."""
    ref = tiny("tiny")
    model = copy.deepcopy(ref)
    gemma4opt.optimize(model, PAGED)
    ids = prompt(1, WINDOW + 3)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        before = model.generate(ids, return_dict_in_generate=True, **kw)
        for m in (ref, model):
            m.config.sliding_window = WINDOW // 2
        want = ref.generate(ids, **kw)
        assert not torch.equal(want, before.sequences)          # the change matters to HF
        with pytest.warns(UserWarning, match=r"sliding_window \(8 -> 4\) after optimize\(\)"):
            assert torch.equal(model.generate(ids, **kw), want)
        fell = {k: v for k, v in model._gemma4opt.fallbacks.items() if "sliding_window" in k}
        assert list(fell.values()) == [1]
        with pytest.raises(ValueError, match="no longer fits the model"):
            model.generate(before.sequences, past_key_values=before.past_key_values,
                           attention_mask=torch.ones_like(before.sequences), max_new_tokens=2)
        del before
        model.config.sliding_window = WINDOW                    # back as it was: the paged path again
        got = model.generate(ids, return_dict_in_generate=True, **kw)
        assert isinstance(got.past_key_values, PagedCache)


@pytest.mark.parametrize("where", ["right", "gap"])
def test_a_mask_that_is_not_left_padding_runs_hfs_path_with_hfs_tokens(where):
    """The paged cache keeps a row's real tokens back to back; HF keeps the masked slots (right
    padding, a gap between tokens) in its cache and its window, so such a call runs HF's path,
    counted and warned once, and a PagedCache refuses to continue such a mask."""
    ref, model = _pair("tiny")
    length = 2 * WINDOW + 1
    ids, mask = prompt(2, length, seed=3), torch.ones(2, length, dtype=torch.long)
    cols = slice(length - 3, None) if where == "right" else slice(4, 7)
    mask[1, cols] = 0
    st = model._gemma4opt
    before = sum(n for k, n in st.fallbacks.items() if "0 after a 1" in k)
    warned = pytest.warns(UserWarning, match="a 0 after a 1") if not before else contextlib.nullcontext()
    with warned:                                        # once per model
        got = _gen(model, ids, attention_mask=mask)
    assert torch.equal(got, _gen(ref, ids, attention_mask=mask))
    assert sum(n for k, n in st.fallbacks.items() if "0 after a 1" in k) == before + 1
    assert any("0 after a 1" in k for k in gemma4opt.report(model, print_table=False).fallbacks)

    left, left_mask = _padded(2, length, seed=3)      # left padding: the paged path, continued with a gap
    out = _gen(model, left, attention_mask=left_mask, return_dict_in_generate=True)
    assert isinstance(out.cache, PagedCache)
    longer = torch.cat([out.sequences, prompt(2, 3, seed=4)], 1)
    gap = _extend(left_mask, longer.shape[1] - left_mask.shape[1])
    gap[0, -4] = 0
    with pytest.raises(ValueError, match=r"attention_mask rows \[0\] hold a 0 after a 1"):
        _gen(model, longer, attention_mask=gap, cache=out.cache)
    with pytest.raises(ValueError, match=r"paged step: attention_mask rows \[0\] hold a 0 after a 1"):
        with torch.no_grad():
            model(longer[:, -3:], attention_mask=gap, past_key_values=out.cache)
    del out


def test_a_mask_hf_infers_from_right_pad_tokens_runs_hfs_path_too():
    """No attention_mask: HF infers one from pad tokens in the ids, right padding included."""
    ref, model = _pair("tiny")
    ids = prompt(2, WINDOW + 3, seed=5)
    ids[1, -2:] = 0
    gaps = lambda: sum(n for k, n in model._gemma4opt.fallbacks.items() if "0 after a 1" in k)  # noqa: E731
    before = gaps()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _gen(model, ids, pad_token_id=0)
    assert torch.equal(got, _gen(ref, ids, pad_token_id=0))
    assert gaps() == before + 1
