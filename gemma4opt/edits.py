"""Every change optimize() makes to a model instance, recorded so it can be taken back.

optimize() is all-or-nothing: a failure reverts what was done so far, and a second optimize()
with another config reverts the first before it starts. Only attributes of objects the model
owns are set (the model, its modules, its own copies of its configs), never a class or module.
"""
from __future__ import annotations

import contextlib
import copy
import weakref

_MISSING = object()


class InstanceEdits:
    def __init__(self):
        self._undo: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        """``obj.name = value``, remembering what was there (an instance attribute, or none). A module
        is held weakly: one the model later drops for good (quantization swaps its projections and
        experts) has nothing left to revert, and a strong record would keep its weights in memory
        (the 26b-a4b's bf16 experts, 46 GB, whose config attribute own_configs set)."""
        import torch

        ref = weakref.ref(obj) if isinstance(obj, torch.nn.Module) else (lambda: obj)
        self._undo.append((ref, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def revert(self) -> None:
        """Put back every attribute in reverse order of setting."""
        while self._undo:
            ref, name, old = self._undo.pop()
            obj = ref()
            if obj is not None:
                _put(obj.__dict__, name, old)

    @contextlib.contextmanager
    def lifted(self, keep: tuple[str, ...] = ()):
        """Every edit but those of the names in ``keep`` taken off for the block and put back after,
        the records kept: the instance as HF made it, to copy it."""
        now = []
        for ref, name, old in reversed(self._undo):
            obj = ref()
            if obj is None or name in keep:
                continue
            now.append((obj, name, obj.__dict__.get(name, _MISSING)))
            _put(obj.__dict__, name, old)
        try:
            yield
        finally:
            for obj, name, value in reversed(now):
                _put(obj.__dict__, name, value)

    def objects(self) -> list:
        """The live objects these edits changed, each once, in order of their first edit."""
        seen = {}
        for ref, _, _ in self._undo:
            obj = ref()
            if obj is not None:
                seen.setdefault(id(obj), obj)
        return list(seen.values())

    def state_before(self, obj, keep: tuple[str, ...] = ()) -> dict:
        """A copy of ``obj.__dict__`` as it was before these edits, the names in ``keep`` as they are
        now (an object's pickled state, without what optimize() set on it)."""
        state = dict(obj.__dict__)
        state.pop("_compiled_call_impl", None)      # as nn.Module.__getstate__ leaves it out
        for ref, name, old in reversed(self._undo):     # the first edit's value before it is put last
            if name not in keep and ref() is obj:
                _put(state, name, old)
        return state


def _put(attrs: dict, name: str, value) -> None:
    if value is _MISSING:
        attrs.pop(name, None)
    else:
        attrs[name] = value


def own_configs(model, edits: InstanceEdits, base=None) -> None:
    """Give the model (and every module that holds one of its configs) private copies of its
    config and generation config: what optimize() writes there must not reach another model
    built from the same config object. ``base`` = (config, generation config, {field: (value before
    optimize() set it, value it set)}): the copies made from those instead (optimized again: the
    caller's edits to the earlier copies stay; optimize()'s own writes, where still there, are
    undone)."""
    from transformers import PretrainedConfig

    old = model.config
    new = copy.deepcopy(old if base is None else base[0])
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
    gen = getattr(model, "generation_config", None) if base is None else base[1]
    if gen is not None:
        gen = copy.deepcopy(gen)
        for name, (before, written) in (base[2] if base is not None else {}).items():
            if getattr(gen, name, None) == written:
                setattr(gen, name, before)
        edits.set(model, "generation_config", gen)
