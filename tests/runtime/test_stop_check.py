"""The deferred stop check is on only inside an optimized model's generate, and only for CUDA;
every other model keeps HF's per-step check. Tokens with the check deferred are compared with
HF eager on a GPU in tests/gpu/test_gpu_generate.py; on the CPU (which has no events, and runs
synchronously anyway) HF's check runs with events stood in, over the paged cache it must crop."""
import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import gemma4opt
from gemma4opt.runtime import stop_check
from tests.models import prompt, tiny

DeferredStopCheck = stop_check._stop_check_class()
pytestmark = pytest.mark.skipif(DeferredStopCheck is None, reason="transformers without DeferredStopCheck")
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class _Probe(StoppingCriteria):
    """Records, at every step inside generate, what HF's gate answers for a CUDA device."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(DeferredStopCheck.is_supported(CUDA, None, False, False))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _generate(model, probe):
    with torch.no_grad():
        return model.generate(prompt(1, 6), max_new_tokens=4, do_sample=False,
                              stopping_criteria=StoppingCriteriaList([probe]))


def test_resolved_default_is_on_for_cuda_only():
    cfg = gemma4opt.Gemma4OptConfig()
    assert cfg.resolve("cpu").deferred_stop is False
    assert cfg.resolve("cuda").deferred_stop is True
    assert gemma4opt.Gemma4OptConfig(deferred_stop=False).resolve("cuda").deferred_stop is False


def test_gate_opens_inside_optimized_generate_only():
    model = gemma4opt.optimize(tiny(), gemma4opt.Gemma4OptConfig(deferred_stop=True))
    assert "deferred" in gemma4opt.report(model, print_table=False).stop_check
    probe = _Probe()
    out = _generate(model, probe)
    assert out.shape == (1, 10)
    assert probe.seen and all(probe.seen)                          # CUDA would defer here
    assert not DeferredStopCheck.is_supported(CUDA, None, False, False)   # outside generate: HF's answer
    assert not DeferredStopCheck.is_supported(CPU, None, False, False)

    plain, probe2 = tiny(seed=3), _Probe()                         # another model, HF untouched
    _generate(plain, probe2)
    assert probe2.seen and not any(probe2.seen)


def test_hf_conditions_still_hold_inside():
    class Uncroppable:
        is_croppable = False

    with_token = stop_check._ACTIVE.set(True)
    try:
        assert DeferredStopCheck.is_supported(CUDA, None, False, False)
        assert not DeferredStopCheck.is_supported(CUDA, None, False, True)            # assisted decoding
        assert not DeferredStopCheck.is_supported(CUDA, Uncroppable(), True, False)   # returned, cannot undo
        assert DeferredStopCheck.is_supported(CUDA, Uncroppable(), False, False)
        # generate is handed the paged cache (so it counts as returned): it can undo the extra step
        from gemma4opt.attention.cache import PagedCache

        assert DeferredStopCheck.is_supported(CUDA, PagedCache.__new__(PagedCache), True, False)
        assert not DeferredStopCheck.is_supported(CPU, None, False, False)
    finally:
        stop_check._ACTIVE.reset(with_token)


def test_off_by_config_leaves_generate_alone():
    model = tiny()
    before = model.generate
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(deferred_stop=False))
    assert gemma4opt.report(model, print_table=False).stop_check.startswith("per step")
    assert model.generate == before


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
    from gemma4opt.attention.cache import PagedCache

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
    assert isinstance(cache, PagedCache) and cache.released
    assert cache.get_seq_length() == want.sequences.shape[1] - 1   # the last token is never fed back
    assert all(s.pages_held() == 0 for s in model._gemma4opt.context.seqs.values())


def test_paged_cache_crop_only_drops():
    from gemma4opt.attention.cache import PagedCache

    cache = PagedCache(None, 2)
    for layer in cache.layers:
        layer.cumulative_length = 9
    cache.crop(0)
    cache.crop(-1)
    assert [layer.get_seq_length() for layer in cache.layers] == [8, 8]
    with pytest.raises(ValueError, match="crop\\(-n\\)"):
        cache.crop(2)
