"""FixedTensors: one optimized model's tensors that keep their address for as long as they live.

Decode graphs (runtime/decode_graphs.py) bake the addresses of their fixed inputs instead of
copying them into the capture each step: the model's parameters and buffers, and what is listed
here (HF's static cache once allocated, the paged KV pool and page tables, the staged step
metadata views). Each model holds its own list, so a second model's tensors never count as fixed
for the first one's graphs. Held weakly: listing a tensor does not keep it alive.
"""
from __future__ import annotations

import weakref

import torch


class FixedTensors:
    def __init__(self):
        self._tensors: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()

    def add(self, t: torch.Tensor) -> torch.Tensor:
        self._tensors[id(t)] = t
        return t

    def ptrs(self) -> set[int]:
        return {t.data_ptr() for t in self._tensors.values()}
