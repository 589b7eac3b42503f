"""Every change optimize() makes to a model instance, recorded so it can be taken back.

optimize() is all-or-nothing: a failure reverts what was done so far, and a second optimize()
with another config reverts the first before it starts. Only attributes of objects the model
owns are set (the model, its modules, its own copies of its configs), never a class or module.
"""
from __future__ import annotations

import copy

_MISSING = object()


class InstanceEdits:
    def __init__(self):
        self._undo: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        """``obj.name = value``, remembering what was there (an instance attribute, or none)."""
        self._undo.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def forget_modules_outside(self, root) -> None:
        """Drop the records of modules no longer in ``root`` (swapped out for good, as quantization
        swaps its projections and experts): reverting them would change nothing the model reaches, and
        holding them would keep their weights in memory (the 26b-a4b's bf16 experts: 46 GB)."""
        import torch

        inside = {id(m) for m in root.modules()}
        self._undo = [r for r in self._undo if not isinstance(r[0], torch.nn.Module) or id(r[0]) in inside]

    def forget_module(self, module) -> None:
        """Drop the records of ``module`` and its submodules, as it is swapped out for good: the
        quantization frees each bf16 module as it goes, so at most one is alive beside the fp8 model
        (the 26b-a4b's 52 GB in bf16 would otherwise peak at 78 GB while its experts are quantized)."""
        gone = {id(m) for m in module.modules()}
        self._undo = [r for r in self._undo if id(r[0]) not in gone]

    def revert(self) -> None:
        """Put back every attribute in reverse order of setting."""
        while self._undo:
            obj, name, old = self._undo.pop()
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old


def own_configs(model, edits: InstanceEdits) -> None:
    """Give the model (and every module that holds one of its configs) private copies of its
    config and generation config: what optimize() writes there must not reach another model
    built from the same config object."""
    from transformers import PretrainedConfig

    old = model.config
    new = copy.deepcopy(old)
    mapping = {id(old): new}

    def walk(o, n):
        for key, value in vars(o).items():
            if isinstance(value, PretrainedConfig) and id(value) not in mapping:
                mapping[id(value)] = getattr(n, key)
                walk(value, getattr(n, key))

    walk(old, new)
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in mapping:
            edits.set(module, "config", mapping[id(held)])
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        edits.set(model, "generation_config", copy.deepcopy(gen))
