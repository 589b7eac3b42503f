"""PagedCache: the transformers Cache that generate carries while KV lives in gemma4opt's pages.

HF only needs lengths from it (positions, generate's bookkeeping); the KV itself is written by
gemma4opt.kv_append and read by gemma4opt.paged_attention through the model's StepContext.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PagedLayer(CacheLayerMixin):
    """Tracks HF's (padded) length of one layer; stores nothing."""

    is_sliding = False
    is_compileable = False

    def __init__(self):
        super().__init__()
        self.cumulative_length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.cumulative_length += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, *args, **kwargs):
        # Masks are not built with a paged cache (attention reads page tables); sizes for completeness.
        query_length = args[0] if args and isinstance(args[0], int) else 1
        return self.cumulative_length + query_length, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.cumulative_length = 0


class PagedCache(Cache):
    """One generate call's cache: its rows in the model's page tables, released when generate ends."""

    # Not croppable, so HF keeps its per-step stop check with this cache (runtime/stop_check.py):
    # FlashInfer's plan() reuses a pinned buffer per wrapper, which a host running a step ahead
    # would overwrite before the previous step's copy of it ran.
    is_croppable = False

    def __init__(self, context, num_layers: int):
        super().__init__(layers=[PagedLayer() for _ in range(num_layers)])
        self.context = context
        self.rows: torch.Tensor | None = None   # set at prefill
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.context.release(self)
            self.released = True
