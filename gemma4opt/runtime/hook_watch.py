"""Module hooks added or removed after optimize(): such calls run HF's own forward.

torch.compile does not guard module hooks by default (Dynamo's ``skip_nnmodule_hook_guards``), so
a forward hook registered on a submodule after the forward was compiled would silently not run.
The hooks present at optimize() are traced into the graphs as any code is; a call made while the
hooks differ from those runs HF's unfused forward instead (a fallback the report counts), and a
generate call runs on HF's cache, so the hooks run exactly as they would without gemma4opt.

Cheap per call: every hook registration goes through ``torch.utils.hooks.RemovableHandle``, whose
id counter moves with each one, so the modules are scanned only when it has moved (or while the
hooks differ, so that removing them is seen). HF's own output-capturing hooks (installed once a
call asks for hidden states, inert otherwise) do not count.
"""
from __future__ import annotations

import torch.nn.modules.module as nn_module
from torch.utils.hooks import RemovableHandle

_MODULE_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_GLOBAL_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks")
_HF_CAPTURE = "transformers.utils.output_capturing"


def _user_hooks(d) -> tuple:
    return tuple(f for f in d.values() if getattr(f, "__module__", None) != _HF_CAPTURE)


class HookWatch:
    def __init__(self, root):
        self.modules = list(root.named_modules())
        self.at_optimize = self._hooks()
        self._seen = RemovableHandle.next_id
        self.changed: str | None = None

    def _hooks(self) -> dict:
        got = {}
        for name in _GLOBAL_DICTS:
            fns = _user_hooks(getattr(nn_module, name))
            if fns:
                got[("every module (global)", name)] = fns
        for where, m in self.modules:
            for name in _MODULE_DICTS:
                d = m.__dict__.get(name)
                fns = _user_hooks(d) if d else ()
                if fns:
                    got[(where or "the model", name)] = fns
        return got

    def reason(self) -> str | None:
        """Why a call must run HF's forward (the hooks differ from optimize()'s), or None."""
        seen = RemovableHandle.next_id
        if seen == self._seen and self.changed is None:
            return None
        self._seen = seen
        now = self._hooks()
        if now == self.at_optimize:
            self.changed = None
            return None
        keys = sorted(k for k in set(now) | set(self.at_optimize) if now.get(k) != self.at_optimize.get(k))
        where = ", ".join(f"{m} {d.strip('_').replace('_', ' ')}" for m, d in keys[:3])
        self.changed = f"module hooks changed after optimize() ({where}{', ...' if len(keys) > 3 else ''})"
        return self.changed
