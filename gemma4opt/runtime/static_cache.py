"""One HF static cache per optimized model, reused by every generate call of the same shape.

HF's generate builds a new StaticCache per call. Decode CUDA graphs bake the cache's addresses,
so a new cache per call means a warm-up step and a capture per call (and the old cache's memory
churning); handing generate back the same cache (reset, as HF resets it) lets every call after
the first replay the graphs captured by the first. Keyed like HF's own sizing: cache
implementation, batch size, and HF's effective length (which only grows per model), and only
the latest shape is kept, so memory holds one cache as with plain HF.

A cache returned by one generate call (``return_dict_in_generate``) is overwritten by the next.
"""
from __future__ import annotations

import functools


def install_static_cache_reuse(model, state, edits) -> None:
    original = getattr(model, "_prepare_static_cache", None)
    if original is None:          # a transformers version without this hook: HF's own caches
        return

    @functools.wraps(original)
    def prepare_static_cache(cache_implementation, batch_size, max_cache_len, prefill_chunk_size, model_kwargs):
        length = max(max_cache_len, getattr(model, "_previous_max_cache_length", -1))
        key = (cache_implementation, batch_size, length)
        kept = state.static_cache
        if kept is not None and kept[0] == key:
            kept[1].reset()
            return kept[1]
        state.static_cache = None   # drop the old one before allocating its successor
        cache = original(cache_implementation, batch_size, max_cache_len, prefill_chunk_size, model_kwargs)
        state.static_cache = (key, cache)
        return cache

    edits.set(model, "_prepare_static_cache", prepare_static_cache)
