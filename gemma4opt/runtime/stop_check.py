"""HF generate's stop check, one step late on CUDA, so the host queues step t+1 while step t runs.

Why: after every decode step HF's ``_sample`` reads ``unfinished_sequences.max() == 0`` on the
host. That read waits for the GPU, so the next step's host work (prepare_inputs, the guard
check, the graph launch) always runs with the GPU idle: measured on an H200 (31b, 12 layers,
batch 1) ~1.3 ms of a 5.5 ms step. transformers already ships the cure, ``DeferredStopCheck``:
the flag is copied to pinned memory asynchronously and read one step later, the one extra
step it may run is undone (``_undo_generation_steps``: ids, scores, logits; the streamer never
sees it), and ``max_length`` is still checked exactly on the host. HF enables it on "mps" only.

We enable it for CUDA, for optimized models only: ``DeferredStopCheck.is_supported`` gets a
wrapper that answers as HF would for an "mps" device while a gemma4opt model's ``generate`` is
running (a context variable set by that instance's ``generate``) and exactly as before
otherwise, so every other model, thread and task keeps HF's behaviour. HF's other conditions
stay in force: not for assisted decoding, and a cache that generate returns must be croppable.
"""
from __future__ import annotations

import contextvars
import functools

import torch

_ACTIVE = contextvars.ContextVar("gemma4opt_deferred_stop_check", default=False)


def _stop_check_class():
    try:
        from transformers.generation import utils
    except ImportError:
        return None
    return getattr(utils, "DeferredStopCheck", None)


def _install_gate(cls) -> None:
    original = cls.is_supported
    if getattr(original, "_gemma4opt_gate", False):
        return

    @functools.wraps(original)
    def is_supported(device, cache, cache_is_returned, is_assistant):
        if _ACTIVE.get() and torch.device(device).type == "cuda":
            device = torch.device("mps")     # HF's gate is the device type; its other checks still apply
        return original(device, cache, cache_is_returned, is_assistant)

    is_supported._gemma4opt_gate = True
    cls.is_supported = staticmethod(is_supported)


def install_deferred_stop_check(model) -> str:
    """Make this instance's generate defer HF's stop check; returns how the stop check runs."""
    cls = _stop_check_class()
    if cls is None or not callable(getattr(cls, "is_supported", None)):
        return "per step (this transformers has no DeferredStopCheck)"
    _install_gate(cls)
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        token = _ACTIVE.set(True)
        try:
            return original(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    model.generate = generate
    return "deferred one step (HF DeferredStopCheck, enabled on CUDA for this model)"
