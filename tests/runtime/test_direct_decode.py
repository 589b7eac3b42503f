"""Decode steps that skip Dynamo's entry within a generate call (runtime/direct_decode.py), on a
CPU with CUDA graphs and FlashInfer stood in (test_paged_graphs). Each direct step is checked
against Dynamo's own guards (``DirectDecode.verify``): the entry they would run must be the one
the plan was learned on. Tokens must equal HF eager's."""
import dataclasses

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import gemma4opt
from gemma4opt import Gemma4OptConfig
from gemma4opt.runtime import direct_decode
from tests.e2e.test_paged_generate import _gen
from tests.models import VARIANTS, WINDOW, prompt, tiny
from tests.runtime.test_paged_graphs import PAGED, _optimize_with_stand_ins


def _direct(model):
    d = model._gemma4opt.direct
    d.verify = True
    return d


@pytest.mark.parametrize("variant", VARIANTS)
def test_direct_steps_pass_dynamos_guards_and_give_eagers_tokens(monkeypatch, variant):
    """Across the sliding window (prompt below it, generate past it), batches of 1 and 3 (a padded
    bucket, left padding), and a generate after another: every direct step passes the guards."""
    model = tiny(variant)
    cases = []
    for batch, length, new in ((1, WINDOW - 2, 2 * WINDOW + 3), (3, WINDOW + 1, 12)):
        ids = prompt(batch, length, seed=length)
        mask = torch.ones_like(ids)
        if batch > 1:
            mask[1, :2] = 0
            ids[1, :2] = 0
        cases.append((ids, mask, new, _gen(model, ids, new=new, attention_mask=mask, min_new_tokens=new)))
    _optimize_with_stand_ins(monkeypatch, model)
    d = _direct(model)
    for ids, mask, new, want in cases * 2:
        assert torch.equal(_gen(model, ids, new=new, attention_mask=mask, min_new_tokens=new), want)
    assert d.plan is None                       # a plan does not outlive its generate call
    assert not d.not_learned, d.not_learned
    # The second round (graphs captured): every decode step but the one each generate learns from
    # runs directly; the first round's too, past its warm-ups and captures.
    steps = sum(new - 1 for _, _, new, _ in cases)
    assert d.steps >= 2 * steps - 3 * len(cases) - len(cases), d.describe()
    rep = gemma4opt.report(model, print_table=False)
    assert rep.direct_steps == d.steps and "run directly" in str(rep)


def test_paged_cache_lengths_equal_hfs_per_layer(monkeypatch):
    """The paged cache counts each layer's tokens after the forward (not in update): what HF's
    DynamicCache holds for every layer that owns KV; KV-shared layers (which HF never updates)
    stay at 0."""
    model = tiny("tiny-ple-shared")
    ids = prompt(2, 7)

    def run(m):
        with torch.no_grad():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, return_dict_in_generate=True)
        return out.sequences, getattr(out, "cache", None) or out.past_key_values

    want, hf = run(model)
    # (HF's cache has a layer per layer that owns KV, and for KV-shared ones a placeholder or none,
    # depending on the transformers version.)
    owners = [i for i, layer in enumerate(hf.layers) if hasattr(layer, "get_seq_length")]
    ctx = _optimize_with_stand_ins(monkeypatch, model)
    assert owners == ctx.updating_layers and len(owners) < model.config.num_hidden_layers
    _direct(model)
    for _ in range(2):
        got, cache = run(model)
        assert torch.equal(got, want)
        assert [cache.layers[i].get_seq_length() for i in owners] == [hf.layers[i].get_seq_length() for i in owners]
        assert all(layer.get_seq_length() == 0 for i, layer in enumerate(cache.layers) if i not in owners)
        cache.release()


class _DeterministicFrom(LogitsProcessor):
    """Turns on deterministic algorithms from inside generate at one step: a global state that
    Dynamo's guards see (the CPU's results do not change with it)."""

    def __init__(self, step):
        self.step, self.calls = step, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.step:
            torch.use_deterministic_algorithms(True)
        return scores


def test_a_global_state_change_within_a_generate_goes_through_dynamo(monkeypatch):
    model = tiny()
    ids = prompt(1, 6)

    def run():
        try:
            return _gen(model, ids, new=12, min_new_tokens=12, attention_mask=torch.ones_like(ids),
                        logits_processor=LogitsProcessorList([_DeterministicFrom(6)]))
        finally:
            torch.use_deterministic_algorithms(False)

    want = run()
    _optimize_with_stand_ins(monkeypatch, model)
    d = _direct(model)
    for _ in range(2):
        assert torch.equal(run(), want)
    assert d.misses["torch's global state changed"] == 2, d.describe()
    assert d.steps > 0


def _set_scale(model, value):
    model.model.layers[0].input_layernorm.with_scale = value


def test_a_model_change_between_generate_calls_is_seen(monkeypatch):
    """The first layer's input norm without its scale after a generate: the next call's first steps enter
    Dynamo, whose guards see it (a new compile), then run directly again; tokens are eager's."""
    model = tiny()
    ids = prompt(1, 6)
    
    def run():
        return _gen(model, ids, new=10, min_new_tokens=10, attention_mask=torch.ones_like(ids))

    before = run()
    _set_scale(model, False)
    after = run()
    _set_scale(model, True)
    assert not torch.equal(before, after)
    _optimize_with_stand_ins(monkeypatch, model)
    d = _direct(model)
    for _ in range(2):
        assert torch.equal(run(), before)
    compiled, steps = model._gemma4opt.graphs_compiled, d.steps
    _set_scale(model, False)
    try:
        for _ in range(2):
            assert torch.equal(run(), after)
        assert model._gemma4opt.graphs_compiled > compiled and d.steps > steps, d.describe()
    finally:
        _set_scale(model, True)
    assert torch.equal(run(), before)


def test_a_plan_misses_on_other_keywords(monkeypatch):
    """A plan checks the call's keywords: another constant, another cache object, a tensor of
    another shape each make it miss (the step then enters Dynamo)."""
    model = tiny()
    ids = prompt(1, 6)
    _optimize_with_stand_ins(monkeypatch, model)
    d = _direct(model)
    seen = {}
    call = direct_decode.DirectDecode.__call__

    def recording(self, kwargs):
        if self.plan is not None:
            seen["plan"], seen["kwargs"] = self.plan, dict(kwargs)
        return call(self, kwargs)

    monkeypatch.setattr(direct_decode.DirectDecode, "__call__", recording)
    _gen(model, ids, new=8, attention_mask=torch.ones_like(ids))
    _gen(model, ids, new=8, attention_mask=torch.ones_like(ids))
    plan, kwargs = seen["plan"], seen["kwargs"]
    plan.signature = None      # (the step context has moved on since; its check is tested above)
    torch.set_grad_enabled(False)               # generate's state, which the plan checks too
    try:
        _check_keywords(plan, kwargs)
    finally:
        torch.set_grad_enabled(True)
    assert plan._check(kwargs) == "torch's global state changed"
    assert d.steps > 0


def _check_keywords(plan, kwargs):
    assert plan._check(kwargs) is None
    assert plan._check(dict(kwargs, logits_to_keep=0)) == "keyword logits_to_keep changed"
    assert plan._check({**kwargs, "use_cache": 1}) == "keyword use_cache changed"       # 1 == True, not the same
    other = next(k for k, v in kwargs.items() if type(v).__name__ == "PagedCache")
    assert plan._check(dict(kwargs, **{other: object()})) == f"keyword {other} is another object"
    assert plan._check(dict(kwargs, input_ids=kwargs["input_ids"].repeat(2, 1))).startswith("keyword input_ids")
    assert plan._check({k: v for k, v in kwargs.items() if k != "use_cache"}) == "other keywords"


def test_switched_off_every_step_enters_dynamo(monkeypatch):
    model = tiny()
    ids = prompt(1, 6)
    want = _gen(model, ids, new=8, attention_mask=torch.ones_like(ids))
    _optimize_with_stand_ins(monkeypatch, model, dataclasses.replace(PAGED, direct_decode=False))
    for _ in range(3):
        assert torch.equal(_gen(model, ids, new=8, attention_mask=torch.ones_like(ids)), want)
    d = model._gemma4opt.direct
    assert d.steps == 0 and d.entered >= 3 * 7


class _Box:
    pass


def _effects_of(fn, *args):
    got = {}

    def backend(gm, example_inputs):
        got["stores"], got["why"] = direct_decode._side_effects()
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return got["stores"], got["why"]


def test_side_effects_a_direct_step_can_and_cannot_replay():
    box = _Box()
    box.flag, box.t = True, None

    def constant_store(x):
        box.flag = False
        return x + 1

    def tensor_store(x):
        box.t = x * 2
        return x + 1

    def dict_write(x, d):
        d["k"] = 1
        return x + 1

    def pure(x):
        return x * box.flag

    x = torch.ones(3)
    stores, why = _effects_of(constant_store, x)
    assert why is None and stores == [(box, "flag", False)]
    box.flag = True
    assert _effects_of(tensor_store, x)[1] is not None
    assert _effects_of(dict_write, x, {})[1] is not None
    assert _effects_of(pure, x) == ([], None)
    assert Gemma4OptConfig().direct_decode is True
    with pytest.raises(TypeError, match="direct_decode"):
        Gemma4OptConfig(direct_decode="yes")


@pytest.mark.parametrize("kernel", ["flashinfer", "mixed"])
def test_direct_steps_on_flashinfers_planned_decode(monkeypatch, kernel):
    """FlashInfer's planned decode (stood in) reads page lists whose length changes as pages come
    and go: its staged inputs are gathered each step and checked; every direct step passes
    Dynamo's guards and the tokens are eager's."""
    model = tiny("tiny-ple-shared")
    config = dataclasses.replace(PAGED, decode_kernel="triton" if kernel == "mixed" else kernel)
    cases = []
    for batch, length in ((1, WINDOW - 1), (3, WINDOW + 3)):
        ids = prompt(batch, length, seed=batch)
        cases.append((ids, _gen(model, ids, new=14, min_new_tokens=14, attention_mask=torch.ones_like(ids))))
    _optimize_with_stand_ins(monkeypatch, model, config,
                             flashinfer_kinds=("full_attention",) if kernel == "mixed" else ())
    d = _direct(model)
    for ids, want in cases * 2:
        assert torch.equal(_gen(model, ids, new=14, min_new_tokens=14, attention_mask=torch.ones_like(ids)), want)
    assert d.steps > 0 and not d.not_learned, d.describe()


class _Collect:
    """A streamer (HF's BaseStreamer interface): every put and the end, in order."""

    def __init__(self):
        self.got = []

    def put(self, value):
        self.got.append(value.clone())

    def end(self):
        self.got.append(None)


class _Ban(LogitsProcessor):
    def __call__(self, ids, scores):
        return scores.index_fill(1, torch.tensor([5]), float("-inf"))


_FEATURES = {
    # A streamer: HF's per-step stop check (no deferral), every token put as it comes.
    "streamer": dict(streamer=_Collect),
    # Classifier-free guidance: a logits processor that calls the model itself, on a cache of its own,
    # between two graphed steps of the generate that holds the paged cache.
    "guidance": dict(guidance_scale=1.5),
    "processors": dict(logits_processor=LogitsProcessorList([_Ban()]), repetition_penalty=1.3,
                       no_repeat_ngram_size=2, sequence_bias={(7,): 5.0}, bad_words_ids=[[3], [4, 6]]),
    "sampling": dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.7, min_p=0.05),
}


@pytest.mark.parametrize("feature", list(_FEATURES))
def test_generate_features_around_the_graphed_steps_give_eagers_tokens(monkeypatch, feature):
    """HF's work between decode steps (streamer, processors, sampling, a processor that runs the model)
    around graphed and direct steps: the same tokens (and streamed tokens) as HF eager's."""
    model = tiny("tiny")
    ids = prompt(3, WINDOW + 1, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0

    def run(m):
        kw = dict(_FEATURES[feature])
        if "streamer" in kw:
            kw["streamer"] = kw["streamer"]()
        torch.manual_seed(0)
        with torch.no_grad():
            out = m.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=8, **kw)
        return out, kw.get("streamer")

    want, streamed = run(model)
    _optimize_with_stand_ins(monkeypatch, model)
    d = _direct(model)
    for _ in range(2):              # the second call replays captured graphs only
        got, streamed_too = run(model)
        assert torch.equal(got, want)
        if streamed is not None:
            assert len(streamed.got) == len(streamed_too.got)
            assert all(a is b is None or torch.equal(a, b) for a, b in zip(streamed.got, streamed_too.got))
    assert model._gemma4opt.graphed_calls > 0 and d.steps > 0, d.describe()
