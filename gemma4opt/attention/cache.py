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

    # HF generate is handed this cache, so it counts as returned: HF defers its stop check
    # (runtime/stop_check.py) only for a cache that can undo the one extra step that costs.
    is_croppable = True

    def __init__(self, context, num_layers: int):
        super().__init__(layers=[PagedLayer() for _ in range(num_layers)])
        self.context = context
        self.rows: torch.Tensor | None = None   # set at prefill
        self.released = False

    def crop(self, tokens_to_remove: int) -> None:
        """Undo HF's extra deferred step (``crop(-1)``) or nothing (``crop(0)``, every step).

        Only the lengths HF reads move back: generate is over when HF undoes a step, and the
        pages that step wrote go back to the pool when generate returns (``release``).
        """
        if tokens_to_remove > 0:
            raise ValueError(f"PagedCache.crop({tokens_to_remove}): only crop(-n) (drop the last n tokens) and "
                             "crop(0) are supported, as HF generate's deferred stop check uses them")
        if tokens_to_remove == 0:
            return                          # every decode step: nothing to do, and no loop over the layers
        for layer in self.layers:
            layer.cumulative_length = max(layer.cumulative_length + tokens_to_remove, 0)

    def release(self) -> None:
        if not self.released:
            self.context.release(self)
            self.released = True
