"""HF generate's stop check, one step late on CUDA, so the host queues step t+1 while step t runs.

Why: after every decode step HF's ``_sample`` reads ``unfinished_sequences.max() == 0`` on the
host. That read waits for the GPU, so the next step's host work (prepare_inputs, the guard
check, the graph launch) always runs with the GPU idle: measured on an H200 (31b, 12 layers,
batch 1) ~1.3 ms of a 5.5 ms step. transformers already ships the cure, ``DeferredStopCheck``:
the flag is copied to pinned memory asynchronously and read one step later, the one extra
step it may run is undone (``_undo_generation_steps``: ids, scores, logits; the streamer never
sees it), and ``max_length`` is still checked exactly on the host. HF enables it on "mps" only.

We enable it for CUDA, for optimized models only, without touching transformers: this
instance's ``generate`` hands HF, for greedy and sampling calls that bring no decoding method
of their own, a ``custom_generate`` that is HF's own ``_sample`` function (same code object)
whose globals see a ``DeferredStopCheck`` subclass answering for a CUDA device as HF answers
for "mps". No class, module attribute or registry changes, so every other model, thread and
task keeps HF's behaviour. HF's other conditions stay in force: not for assisted decoding, and
a cache that generate returns must be croppable. Not with a streamer either: there the deferred
check of the transformers seen here streamed the prompt and none of the new tokens.
"""
from __future__ import annotations

import functools
import types

import torch

from gemma4opt.step_inputs import generation_config_of


def _stop_check_class():
    try:
        from transformers.generation import utils
    except ImportError:
        return None
    return getattr(utils, "DeferredStopCheck", None)


def deferred_sample():
    """HF's ``_sample`` with a CUDA-deferring DeferredStopCheck in its globals, or None when this
    transformers has no such check (or ``_sample`` does not use it)."""
    cls = _stop_check_class()
    from transformers.generation.utils import GenerationMixin

    sample = getattr(GenerationMixin, "_sample", None)
    if cls is None or not isinstance(sample, types.FunctionType) or "DeferredStopCheck" not in sample.__code__.co_names:
        return None

    class CudaDeferredStopCheck(cls):
        @staticmethod
        def is_supported(device, cache, cache_is_returned, is_assistant):
            device = torch.device(device)
            if device.type == "cuda":
                device = torch.device("mps")     # HF's gate is the device type; its other checks still apply
            return cls.is_supported(device, cache, cache_is_returned, is_assistant)

    scope = dict(sample.__globals__, DeferredStopCheck=CudaDeferredStopCheck)
    fn = types.FunctionType(sample.__code__, scope, sample.__name__, sample.__defaults__, sample.__closure__)
    fn.__kwdefaults__ = sample.__kwdefaults__
    fn.__qualname__ = sample.__qualname__
    return functools.update_wrapper(fn, sample, updated=())


def _is_sample_mode(model, kwargs) -> bool:
    """HF's own answer: does this call decode greedily or by sampling (HF's ``_sample``)?"""
    from transformers.generation.configuration_utils import GenerationMode

    gen = generation_config_of(model, kwargs)
    if gen is None:       # HF raises its own error for bad arguments in generate itself
        return False
    return gen.get_generation_mode(kwargs.get("assistant_model")) in (GenerationMode.SAMPLE,
                                                                       GenerationMode.GREEDY_SEARCH)


def install_deferred_stop_check(model, edits) -> str:
    """Make this instance's generate defer HF's stop check; returns how the stop check runs."""
    sample = deferred_sample()
    if sample is None:
        return "per step (this transformers has no DeferredStopCheck)"
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        # A streamer gets HF's per-step check: with the deferred one, the streamer of the
        # transformers seen here received the prompt and then none of the new tokens.
        own = kwargs.get("custom_generate") is not None or kwargs.get("streamer") is not None
        if not own and _is_sample_mode(model, kwargs):
            kwargs["custom_generate"] = sample
        return original(*args, **kwargs)

    edits.set(model, "generate", generate)
    return "deferred one step (HF DeferredStopCheck, enabled on CUDA for this model)"
