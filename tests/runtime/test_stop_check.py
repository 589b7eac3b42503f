"""The deferred stop check is on only inside an optimized model's generate, and only for CUDA;
every other model keeps HF's per-step check. Tokens with the check deferred are compared with
HF eager on a GPU in tests/gpu/test_gpu_generate.py (the CPU has no events to defer with)."""
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
        # generate is handed the paged cache (so it counts as returned): HF's per-step check stays
        from gemma4opt.attention.cache import PagedCache

        assert not DeferredStopCheck.is_supported(CUDA, PagedCache.__new__(PagedCache), True, False)
        assert not DeferredStopCheck.is_supported(CPU, None, False, False)
    finally:
        stop_check._ACTIVE.reset(with_token)


def test_off_by_config_leaves_generate_alone():
    model = tiny()
    before = model.generate
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(deferred_stop=False))
    assert gemma4opt.report(model, print_table=False).stop_check.startswith("per step")
    assert model.generate == before
