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


class HostStaging:
    def __init__(self, device, capacity: int = 1 << 16):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copies = 0                # host->device copies issued (one per step)
        self._slot = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        buffers = 2 if self.cuda else 1
        self.host = [torch.empty(capacity, dtype=torch.int32, pin_memory=self.cuda) for _ in range(buffers)]
        self.host_np = [h.numpy() for h in self.host]
        self.events = [None] * len(self.host)
        # Views per layout (names and shapes): decode steps stage the same layout every step, and
        # cutting a buffer into views costs µs per view. The views alias the one device buffer.
        self._views: dict[tuple, dict[str, torch.Tensor]] = {}
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device) if self.cuda else None

    def stage(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Device int32 tensors (views of one buffer) with the contents of ``arrays``."""
        vals = [np.asarray(a) for a in arrays.values()]
        sizes = [a.size for a in vals]
        total = sum(sizes)
        if total > self.capacity:
            self._alloc(max(total, 2 * self.capacity))   # rare: grows geometrically; old copies have been issued
        slot = self._slot
        self._slot = (slot + 1) % len(self.host)
        if self.events[slot] is not None and not self.events[slot].query():
            self.events[slot].synchronize()           # the host is two steps ahead of this copy
        host = self.host[slot]
        # One numpy call packs, one torch call cuts the views (per-array Python here costs µs each).
        np.concatenate([a.reshape(-1) for a in vals], out=self.host_np[slot][:total], casting="unsafe")
        if self.cuda:
            self.dev[:total].copy_(host[:total], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.events[slot] = ev
            base = self.dev
        else:
            base = host
        self.copies += 1
        key = (tuple(arrays), tuple(a.shape for a in vals))
        out = self._views.get(key)
        if out is None:
            if len(self._views) > 64:
                self._views.clear()           # layouts seen once (prefills, page-table updates)
            views = base[:total].split(sizes)
            out = self._views[key] = {name: (v if a.ndim == 1 else v.view(a.shape))
                                      for name, v, a in zip(arrays, views, vals)}
        return out
