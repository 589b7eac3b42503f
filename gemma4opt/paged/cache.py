"""PagedCache: the transformers Cache that generate carries while KV lives in gemma4opt's pages.
Each cache holds rows of the model's page tables until it is released (or garbage-collected).

HF only needs lengths from it (positions, generate's bookkeeping); the KV itself is written by
gemma4opt.kv_append and read by the attention backends' ops (paged/backends/) through the model's StepContext.

The lengths advance once per forward, after it returns (``PagedCache.advance``, called by
paged/forward.py), not in ``update`` inside the compiled forward: a count stored there is a side
effect Dynamo's code replays after every step, and a decode step without side effects can skip
Dynamo's entry (runtime/direct_decode.py). Nothing reads the count between ``update`` and the end of the
forward, so what HF sees is the same.
"""
from __future__ import annotations

import weakref

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
        return key_states, value_states         # counted by PagedCache.advance (module doc)

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
    """A generate call's cache: its own rows of the model's page tables (StepContext's row
    allocator hands them out at its first step) and the KV pages they hold.

    Returned to the caller (``return_dict_in_generate=True``) it keeps its pages while the caller
    holds it: ``generate(longer_ids, past_key_values=cache)`` continues it. The pages and rows go
    back to the pool on ``release()`` / ``reset()`` (the cache is then empty and can start
    again) or when it is garbage-collected.
    """

    # HF generate is handed this cache, so it counts as returned: HF defers its stop check
    # (runtime/stop_check.py) only for a cache that can undo the one extra step that costs.
    is_croppable = True
    record_past = False

    def __init__(self, context, num_layers: int):
        super().__init__(layers=[PagedLayer() for _ in range(num_layers)])
        self.context = context
        # The layers HF calls ``update`` on (those owning KV; KV-shared layers stay at 0, as in HF).
        owners = getattr(context, "updating_layers", None)
        self._counted = [self.layers[i] for i in (range(num_layers) if owners is None else owners)]
        # The rows live in a holder the finalizer shares (it must not hold the cache itself).
        self._held = {"rows": None}
        self._finalizer = weakref.finalize(self, _release_when_collected, context, self._held)
        self._finalizer.atexit = False

    @property
    def rows(self):
        """This cache's rows of the page tables (numpy int64), or None before its first step."""
        return self._held["rows"]

    @rows.setter
    def rows(self, rows) -> None:
        self._held["rows"] = rows

    @property
    def released(self) -> bool:
        return self._held["rows"] is None

    def advance(self, tokens: int) -> None:
        """A forward of ``tokens`` tokens per sequence ran: the count ``update`` keeps in HF's caches."""
        for layer in self._counted:
            layer.cumulative_length += tokens

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """HF's call before it may crop several tokens (assisted decoding) or its last step (the
        deferred stop check): sliding layers keep RECORD_MARGIN tokens past their window for
        this cache's rows, so the window of what is left after a crop is still in the pages.
        ``recurrent_states_to_keep`` (transformers 5.25+) is for linear-attention layers' states;
        Gemma-4 has none, so it is taken and ignored."""
        self.record_past = True
        if self.rows is not None:
            self.context.record_past(self.rows)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens: HF's deferred stop check undoing its extra
        step (``crop(-1)``), assisted decoding removing rejected draft tokens; ``crop(0)`` does
        nothing. The paged sequences shrink too (pages past the new end go back to the pool),
        so the next step writes where the dropped tokens were."""
        tokens_to_remove = int(tokens_to_remove)    # HF's assisted decoding passes a 0-d tensor
        if tokens_to_remove > 0:
            raise ValueError(f"PagedCache.crop({tokens_to_remove}): pass -n to drop the last n tokens (as HF's "
                             "caches do); a positive length is not supported")
        if tokens_to_remove == 0:
            return                          # every decode step: nothing to do, and no loop over the layers
        n = -tokens_to_remove
        length = self.get_seq_length()
        if n > length:
            raise ValueError(f"PagedCache.crop({tokens_to_remove}): the cache holds {length} tokens")
        if self.rows is not None:
            self.context.crop(self.rows, n)         # first: it refuses before anything changes
        for layer in self.layers:
            layer.cumulative_length = max(layer.cumulative_length - n, 0)

    def release(self) -> None:
        """Give the pages and rows back to the pool; the cache is empty afterwards."""
        _release_rows(self.context, self._held)
        for layer in self.layers:
            layer.reset()

    def reset(self) -> None:
        self.release()


def _release_rows(context, held) -> None:
    rows, held["rows"] = held["rows"], None
    if rows is not None:
        context.release_rows(rows)


def _release_when_collected(context, held) -> None:
    # The garbage collector may run this in the middle of anything (another cache's page work, a
    # Dynamo trace): only queue the rows; the context frees them before its next page work.
    rows, held["rows"] = held["rows"], None
    if rows is not None:
        context.collected.append(rows)
