"""The deferred stop check, per instance: an optimized model's generate hands HF, for greedy and
sampling calls only, a ``custom_generate`` that is HF's own ``_sample`` (same code object) whose
globals see a DeferredStopCheck subclass answering for a CUDA device as HF answers for "mps".
Nothing in transformers changes. On the CPU the subclass answers exactly like HF (never defers).
Tokens with the check deferred are compared with HF eager on a GPU in tests/gpu/test_gpu_generate.py;
on the CPU (no events; it runs synchronously anyway) HF's deferred check runs with events stood in,
over the paged cache it must crop."""
import pytest
import torch
from transformers import Gemma4ForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation import utils as hf_utils
from transformers.generation.utils import GenerationMixin

import gemma4opt
from gemma4opt.runtime import stop_check
from tests.models import prompt, tiny

DeferredStopCheck = stop_check._stop_check_class()
pytestmark = pytest.mark.skipif(stop_check.deferred_sample() is None,
                                reason="transformers without DeferredStopCheck in _sample")
CUDA, CPU, MPS = torch.device("cuda"), torch.device("cpu"), torch.device("mps")


class _Uncroppable:
    is_croppable = False


def _subclass():
    return stop_check.deferred_sample().__globals__["DeferredStopCheck"]


def test_resolved_default_is_on_for_cuda_only():
    cfg = gemma4opt.Gemma4OptConfig()
    assert cfg.resolve("cpu").deferred_stop is False
    assert cfg.resolve("cuda").deferred_stop is True
    assert gemma4opt.Gemma4OptConfig(deferred_stop=False).resolve("cuda").deferred_stop is False


def test_deferred_sample_is_hfs_sample_with_one_global_changed():
    fn, hf = stop_check.deferred_sample(), GenerationMixin._sample
    assert fn is not hf and fn.__code__ is hf.__code__
    assert fn.__defaults__ == hf.__defaults__ and fn.__kwdefaults__ == hf.__kwdefaults__
    assert fn.__globals__ is not hf.__globals__
    assert {k for k in fn.__globals__ if fn.__globals__[k] is not hf.__globals__.get(k)} == {"DeferredStopCheck"}
    assert issubclass(_subclass(), DeferredStopCheck) and _subclass() is not DeferredStopCheck
    assert hf_utils.DeferredStopCheck is DeferredStopCheck and hf.__globals__["DeferredStopCheck"] is DeferredStopCheck


@pytest.mark.parametrize("cache, returned", [(None, False), (None, True), (_Uncroppable(), False),
                                             (_Uncroppable(), True), ("paged", True)])
@pytest.mark.parametrize("assistant", [False, True])
def test_subclass_answers_like_hf(cache, returned, assistant):
    """Off CUDA exactly HF's answer (the CPU never defers); on CUDA HF's answer for "mps", so HF's
    own conditions hold: not for an assistant, not for a returned cache that cannot be cropped."""
    if cache == "paged":
        from gemma4opt.paged.cache import PagedCache

        cache = PagedCache.__new__(PagedCache)        # generate is handed the paged cache: croppable
    sub = _subclass()
    for device in (CPU, "cpu", torch.device("meta")):
        assert sub.is_supported(device, cache, returned, assistant) is False
        assert DeferredStopCheck.is_supported(torch.device(device), cache, returned, assistant) is False
    want = DeferredStopCheck.is_supported(MPS, cache, returned, assistant)
    assert sub.is_supported(CUDA, cache, returned, assistant) == want
    assert sub.is_supported("cuda:0", cache, returned, assistant) == want
    assert want == (not assistant and (cache is None or not returned or cache.is_croppable))
    assert DeferredStopCheck.is_supported(CUDA, cache, returned, assistant) is False   # HF's class: untouched


@pytest.fixture
def seen_kwargs(monkeypatch):
    """generate of the model class records its keyword arguments and returns them (no generation)."""
    calls = []

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return kwargs

    monkeypatch.setattr(Gemma4ForCausalLM, "generate", spy)
    return calls


@pytest.mark.parametrize("paged", [False, True])
def test_custom_generate_only_for_greedy_and_sampling(seen_kwargs, paged):
    cfg = dict(attention="paged", page_size=4, max_seq_len=64, max_batch_size=2) if paged else {}
    model = gemma4opt.optimize(tiny(), gemma4opt.Gemma4OptConfig(deferred_stop=True, **cfg))
    assert "deferred" in gemma4opt.report(model, print_table=False).stop_check
    ids = prompt(1, 5)

    def handed(**kw):
        return model.generate(ids, max_new_tokens=2, **kw).get("custom_generate")

    for kw in (dict(do_sample=False), dict(do_sample=True), dict(do_sample=True, top_k=5),
               dict(generation_config=model.generation_config)):
        fn = handed(**kw)
        assert fn is not None and fn.__code__ is GenerationMixin._sample.__code__, kw
    assert handed(num_beams=2) is None
    assert handed(num_beams=2, num_return_sequences=2) is None
    assert handed(assistant_model=tiny(seed=4)) is None
    assert handed(prompt_lookup_num_tokens=3) is None
    mine = object()
    assert handed(custom_generate=mine) is mine
    assert handed(do_sample=False, streamer=object()) is None    # a streamer gets HF's per-step check

    plain = tiny(seed=3)                       # another model: HF's generate as is, nothing handed
    plain.generate(ids, max_new_tokens=2, do_sample=False)
    assert "custom_generate" not in seen_kwargs[-1] and "generate" not in vars(plain)


def test_off_by_config_hands_nothing(seen_kwargs):
    model = gemma4opt.optimize(tiny(), gemma4opt.Gemma4OptConfig(deferred_stop=False))
    assert gemma4opt.report(model, print_table=False).stop_check.startswith("per step")
    model.generate(prompt(1, 5), max_new_tokens=2, do_sample=False)
    assert "custom_generate" not in seen_kwargs[-1]


def test_on_cpu_hf_never_defers(monkeypatch):
    """A real generate on the CPU through the deferred sample: HF's per-step check runs (no
    DeferredStopCheck is made), tokens equal HF's, another model's generate is untouched."""
    made = []
    real_init = DeferredStopCheck.__init__

    def init(self, *a, **k):
        made.append(type(self))
        real_init(self, *a, **k)

    monkeypatch.setattr(DeferredStopCheck, "__init__", init)
    ids = prompt(2, 6)
    with torch.no_grad():
        want = tiny().generate(ids, max_new_tokens=3, do_sample=False)
        model = gemma4opt.optimize(tiny(), gemma4opt.Gemma4OptConfig(deferred_stop=True))
        got = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    assert made == []


class _Event:
    """torch.Event for the CPU, where every copy is done when issued."""

    def __init__(self, *a, **k):
        pass

    def record(self, *a):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Eos(StoppingCriteria):
    """Row r stops at step ``at[r]`` (a stand-in for eos that the deferred check must see late)."""

    def __init__(self, at):
        self.at, self.step = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.step += 1
        return torch.tensor([self.step >= a for a in self.at])


@pytest.mark.parametrize("stop_at", [(3, 3), (2, 5), (99, 99)])
def test_paged_cache_under_hf_deferred_check_gives_per_step_results(monkeypatch, stop_at):
    """The paged cache is croppable: HF's deferred check (one extra step, then crop(-1)) gives the
    same ids, scores and cache length as the per-step check, stopping early or at max_new_tokens."""
    from gemma4opt.paged.cache import PagedCache

    ids = prompt(2, 7, seed=5)

    def run(model, deferred):
        kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  stopping_criteria=StoppingCriteriaList([_Eos(stop_at)]), pad_token_id=0)
        with torch.no_grad():
            return model.generate(ids, **kw)

    want = run(tiny(), deferred=False)
    model = gemma4opt.optimize(tiny(), gemma4opt.Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=64,
                                                                  max_batch_size=2, deferred_stop=True))
    finished = []
    original = DeferredStopCheck.is_supported
    monkeypatch.setattr(DeferredStopCheck, "is_supported",    # HF's own answer, as for a device it defers on
                        staticmethod(lambda device, cache, cache_is_returned, is_assistant:
                                                     original(torch.device("mps"), cache, cache_is_returned, is_assistant)))
    monkeypatch.setattr(torch, "Event", _Event)
    real_finish = DeferredStopCheck.finish

    def finish(self):
        finished.append(real_finish(self))
        return finished[-1]

    monkeypatch.setattr(DeferredStopCheck, "finish", finish)
    got = run(model, deferred=True)
    assert finished, "HF did not defer its stop check with the paged cache"
    assert finished == [1 if max(stop_at) < 6 else 0]           # the extra step is undone only on an early stop
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got.scores, want.scores))
    cache = got.past_key_values
    # Returned (return_dict_in_generate): the cache keeps its pages for a continuation until released.
    assert isinstance(cache, PagedCache) and not cache.released
    assert cache.get_seq_length() == want.sequences.shape[1] - 1   # the last token is never fed back
    seqs = model._gemma4opt.context.seqs
    assert seqs["full_attention"].seq_len[cache.rows].tolist() == [cache.get_seq_length()] * 2   # crop reached the pages
    cache.release()
    assert all(s.pages_held() == 0 for s in seqs.values())


def test_paged_cache_crop_only_drops():
    from gemma4opt.paged.cache import PagedCache

    cache = PagedCache(None, 2)
    for layer in cache.layers:
        layer.cumulative_length = 9
    cache.crop(0)
    cache.crop(-1)
    assert [layer.get_seq_length() for layer in cache.layers] == [8, 8]
    with pytest.raises(ValueError, match="pass -n to drop the last n tokens"):
        cache.crop(2)


def test_paged_cache_takes_hfs_past_recording_call_of_either_version():
    """transformers <= 5.24 calls activate_past_recording(); 5.25 passes recurrent_states_to_keep
    (for linear-attention states, which Gemma-4 has none of) and asks get_recurrent_states_to_keep()."""
    from gemma4opt.paged.cache import PagedCache

    for kwargs in ({}, {"recurrent_states_to_keep": 3}, {"recurrent_states_to_keep": None}):
        cache = PagedCache(None, 2)
        cache.activate_past_recording(**kwargs)
        assert cache.record_past is True
        if hasattr(cache, "get_recurrent_states_to_keep"):
            assert cache.get_recurrent_states_to_keep() == 0
