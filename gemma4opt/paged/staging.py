"""HostStaging: a step's small int arrays to the device in one async copy, never read back.

Every array of a step (page metadata of each attention kind, token index, new lengths) is packed
into one int32 host buffer, copied with one ``non_blocking`` copy, and handed out as views of
the device buffer. On CUDA the host buffers are pinned and double-buffered: the buffer written
for step n+2 is the one step n copied from, and an event recorded after that copy says whether
the GPU has read it yet (it has, unless the host ran two steps ahead: then, and only then, the
host waits on that event). On the CPU the views alias the packed buffer: no copy at all.
"""
from __future__ import annotations

import numpy as np
import torch

from gemma4opt.fixed_tensors import FixedTensors


class HostStaging:
    def __init__(self, device, fixed: FixedTensors | None = None, capacity: int = 1 << 16):
        self.device = torch.device(device)
        self.fixed = fixed if fixed is not None else FixedTensors()
        self.cuda = self.device.type == "cuda"
        self.copies = 0                # host->device copies issued (one per step)
        self._slot = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        buffers = 2 if self.cuda else 1
        self.host = [torch.empty(capacity, dtype=torch.int32, pin_memory=self.cuda) for _ in range(buffers)]
        self.host_np = [h.numpy() for h in self.host]
        # One event per host buffer, re-recorded after each copy from it (creating one costs µs);
        # an event not recorded yet counts as complete.
        self.events = [torch.cuda.Event() for _ in self.host] if self.cuda else []
        # Per layout (names and shapes): sizes, the packed slices of each buffer and the device
        # views. Decode steps stage the same layout every step, and slicing or cutting views costs
        # µs each. The views alias the one device buffer, so their addresses are the same every
        # step of a layout: marked fixed, decode graphs read them in place (no per-step copy).
        self._layouts: dict[tuple, tuple] = {}
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device) if self.cuda else None

    def stage(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Device int32 tensors (views of one buffer) with the contents of ``arrays`` (numpy).

        The views of a layout are the same objects at the same addresses every call: their
        contents are this call's until the next call of any layout."""
        key = tuple((name, a.shape) for name, a in arrays.items())
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(key, arrays)
        total, packed, copies, views = layout
        slot = self._slot
        self._slot = (slot + 1) % len(self.host)
        if self.cuda and not self.events[slot].query():
            self.events[slot].synchronize()           # the host is two steps ahead of this copy
        # One numpy call packs every array (per-array Python here costs µs each).
        np.concatenate([a.reshape(-1) for a in arrays.values()], out=packed[slot], casting="unsafe")
        if self.cuda:
            dst, src = copies[slot]
            dst.copy_(src, non_blocking=True)
            self.events[slot].record()
        self.copies += 1
        return views

    def _layout(self, key, arrays) -> tuple:
        sizes = [int(np.prod(shape)) for _, shape in key]
        total = sum(sizes)
        if total > self.capacity:
            # Rare: grows geometrically. Copies already issued keep the old buffers alive until
            # they ran (the caching allocator orders the frees on the stream; pinned blocks are
            # freed only once their copy's event completed).
            self._alloc(max(total, 2 * self.capacity))
        if len(self._layouts) > 64:
            self._layouts.clear()           # layouts seen once (prefills, page-table updates)
        base = self.dev if self.cuda else self.host[0]
        views = {name: (v if len(shape) == 1 else v.view(shape))
                 for (name, shape), v in zip(key, base[:total].split(sizes))}
        for v in views.values():
            self.fixed.add(v)
        packed = [h[:total] for h in self.host_np]
        copies = [(self.dev[:total], h[:total]) for h in self.host] if self.cuda else None
        layout = self._layouts[key] = (total, packed, copies, views)
        return layout
