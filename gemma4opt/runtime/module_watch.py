"""Submodules replaced after optimize(): the model is optimized again for its new modules.

A submodule swapped in after optimize() (a LoRA wrapper around a projection, a new MLP, a
resized embedding) can pass Dynamo's guards when its type and tensor shapes match the old one's,
and the graphs rewritten for the old modules (merged weights, fp8 copies) would then run the old
weights: HF's forward would use the new module, gemma4opt the old, silently. So every edge of
the module tree (parent, name, child) as optimize() left it is compared by identity before each
call that could follow such a change (each generate call's start, every forward outside
generate; ~30 µs for a 42-layer model's ~900 edges on a CPU), and a change re-optimizes the model
as a move does.
"""
from __future__ import annotations


class ModuleTreeWatch:
    def __init__(self, root):
        self.edges = [(parent._modules, key, child, f"{path}.{key}" if path else key)
                      for path, parent in root.named_modules() for key, child in parent._modules.items()]

    def replaced(self) -> list[str]:
        """The paths whose module is no longer the one optimize() saw (replaced, removed, or None)."""
        if all(d.get(k) is c for d, k, c, _ in self.edges):
            return []
        return [path for d, k, c, path in self.edges if d.get(k) is not c]
