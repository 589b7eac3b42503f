"""The one interface every paged attention backend implements, and the geometry it is given.

A backend runs the attention of one attention kind (sliding or full layers) for the steps the
StepContext picks it for. It is built once per model and kind from a ``KindGeometry``; it says up
front which geometry it refuses and why (``refuses``); before each step it picks, the step hands
it that step's metadata on the host and on the device (``prepare``: FlashInfer plans there,
the others count); inside the traced forward it runs one layer through its own custom op with
exactly the tensors that op reads (``attend``); and it reports what it did (``stats``). No
backend knows another: the StepContext (paged/step.py) is the only place that chooses.

The page metadata a backend reads comes in one of two shapes, said by ``reads_table``:
- page lists (``tables.StepMeta``: indptr, indices, last-page lengths...), built on the host for
  the step, of which the step stages on the device the fields in ``device_fields``;
- the kind's device page table [max_batch, ring] and one length per query row, kept current
  without page lists (decode steps: no host plan at all).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class KindGeometry:
    """What a backend must handle for one attention kind, on one device (and, with tensor
    parallelism, one rank: ``heads`` and ``kv_heads`` are that rank's share)."""

    kind: str                  # "sliding_attention" or "full_attention"
    heads: int                 # query heads
    kv_heads: int
    head_dim: int
    page_size: int
    window: int | None         # sliding window (HF's bound: it counts the query itself), None for full
    dtype: torch.dtype         # queries and outputs
    kv_dtype: torch.dtype      # the KV pool's: ``dtype``, or float8_e4m3fn (kv_cache_dtype="fp8")
    scale: float = 1.0
    last_token_layers: bool = False   # KV-shared layers that query only the last token at prefill
    device: str = "cpu"


class Backend:
    """Base class: see the module doc. Subclasses set the class attributes and override the methods."""

    name = "?"
    op_name = "?"                                 # its torch.ops.gemma4opt op (patterns/paged_qkv.py finds it)
    reads_table = False                           # decodes from the device page table (no page lists)
    device_fields: tuple[str, ...] = ()           # page-list fields its op or its prepare reads on the device
    op_fields: tuple[str, ...] = ()               # of those, the ones its op takes (the rest only prepare reads)
    needs_new_lens = False                        # its op reads the new tokens per sequence

    def __init__(self, geometry: KindGeometry):
        self.geometry = geometry

    @classmethod
    def refuses(cls, geometry: KindGeometry) -> str | None:
        """Why this backend cannot run ``geometry`` (checked once, when the model is optimized), or None."""
        return None

    def bind_kv_scales(self, host_scales: dict[int, tuple[float, float]]) -> None:
        """An fp8 pool's scales as host floats, layer -> (k, v): the StepContext's own dict (set_kv_scales
        updates it in place). Ignored by backends that read the device scale tensors ``attend`` gets;
        FlashInfer keeps it (it takes scales as floats)."""

    def prepare(self, host, dev: dict[str, torch.Tensor], pad_to: int | None) -> None:
        """Host work before a step this backend runs: ``host`` is the kind's page lists
        (``tables.StepMeta``; None for a table backend), ``dev`` the step's staged device tensors
        (named ``"{kind}.{field}"``), ``pad_to`` the rows of a graphed step (None: not graphed)."""

    def attend(self, q: torch.Tensor, kv: torch.Tensor, meta: dict[str, torch.Tensor], token_index: torch.Tensor,
               new_lens: torch.Tensor | None, window: int, scale: float, kv_scale: torch.Tensor | None = None,
               layer: int = -1) -> torch.Tensor:
        """One layer's attention: ``q`` [B, T, heads, D] -> [B, T, heads, D]. Runs inside the traced
        forward: calls this backend's op, passing what it reads and nothing else. An fp8 pool comes
        with ``kv_scale``, the [k, v] fp32 scales of ``layer`` (the layer that owns ``kv``)."""
        raise NotImplementedError

    def stats(self) -> dict[str, object]:
        """What the report shows for this backend (counts, reasons)."""
        return {}

    def check_layer(self, window: int, scale: float) -> None:
        """A layer of this kind must have the geometry's window and scale (checked at trace time)."""
        g = self.geometry
        if (window if window > 0 else None) != g.window or scale != g.scale:
            raise RuntimeError(f"gemma4opt paged attention: a {g.kind} layer has window {window} and scale {scale}; "
                               f"its kind's {self.name} backend was built for window {g.window}, scale {g.scale}")


def is_prefix(rows: np.ndarray) -> bool:
    """Rows 0..n-1 in order: what a table backend needs (it reads table row b for batch row b)."""
    return len(rows) > 0 and rows[0] == 0 and rows[-1] == len(rows) - 1
