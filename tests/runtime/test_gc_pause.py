"""pause_gc: Python's garbage collector off while an optimized model's generate runs, and the
caller's state back after (also when generate raises); nothing changes outside the call."""
import gc

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import gemma4opt
from gemma4opt.runtime.gc_pause import gc_paused
from tests.models import prompt, tiny


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


class _SeesCollector(LogitsProcessor):
    """Records, at every decode step, whether the collector is on."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores):
        self.seen.append(gc.isenabled())
        return scores


def test_paused_inside_and_restored_after_also_on_error():
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_caller_who_turned_it_off_keeps_it_off():
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_resolved_default_is_on_for_cuda_only():
    cfg = gemma4opt.Gemma4OptConfig()
    assert cfg.resolve("cpu").pause_gc is False and cfg.resolve("cuda").pause_gc is True
    assert gemma4opt.Gemma4OptConfig(pause_gc=False).resolve("cuda").pause_gc is False
    assert gemma4opt.Gemma4OptConfig(pause_gc=True).resolve("cpu").pause_gc is True


@pytest.mark.parametrize("pause", [True, False])
def test_generate_runs_with_the_collector_paused_when_asked(pause):
    model = gemma4opt.optimize(tiny(), gemma4opt.Gemma4OptConfig(pause_gc=pause))
    eager = tiny()
    ids = prompt(1, 6)
    seen = _SeesCollector()
    out = model.generate(ids, max_new_tokens=4, do_sample=False, logits_processor=LogitsProcessorList([seen]))
    assert seen.seen and all(on is not pause for on in seen.seen), seen.seen
    assert gc.isenabled(), "the caller's collector state comes back after generate"
    assert torch.equal(out, eager.generate(ids, max_new_tokens=4, do_sample=False))
    assert ("generate garbage collection: paused" in str(gemma4opt.report(model))) is pause


def test_restored_when_generate_raises():
    model = gemma4opt.optimize(tiny(), gemma4opt.Gemma4OptConfig(pause_gc=True))

    class _Fails(LogitsProcessor):
        def __call__(self, input_ids, scores):
            raise RuntimeError("processor failed")

    with pytest.raises(RuntimeError, match="processor failed"):
        model.generate(prompt(1, 6), max_new_tokens=3, do_sample=False, logits_processor=LogitsProcessorList([_Fails()]))
    assert gc.isenabled()
