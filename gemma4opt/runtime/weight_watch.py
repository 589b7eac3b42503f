"""Merged projection weights replaced after optimize(): their new values reach the graphs.

optimize() merges q/k/v and gate/up into one weight each and leaves the projections' weights as
views of it (patterns/merged_projections.py); the graphs read the merged weight. An in-place
edit of a weight (``load_state_dict``'s copy, ``w.mul_()``) writes through the view, but a weight
given new storage (``lin.weight.data = w``, a new Parameter, ``load_state_dict(assign=True)``)
would leave the merged weight stale: HF's forward would use the new values, gemma4opt the old,
silently. Dynamo does not see it (its tensor guards compare shape, dtype and strides).

So the views' addresses are compared before every call that could follow such a change: each
generate call's start and every forward call outside generate (a change from inside a generate
call, by a logits processor or streamer, is seen from the next call on, as with direct decode
steps). A moved weight is copied into the merged one in place and made its view again, so no
graph is compiled or captured again. The check is one address compare per projection.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8 import quantize_weight_reference
from gemma4opt.ops.fp8_weights import Fp8Linear
from gemma4opt.patterns.merged_projections import merged_groups, restore_views, scale_attr


class MergedWeightWatch:
    def __init__(self, root):
        names = {m: n for n, m in root.named_modules()}
        # each linear's rows in its merged weight, as merged: a replaced weight may have other rows
        self.groups = [(module, linears, [lin.weight.shape[0] for lin in linears], names.get(module, "?"))
                       for module, linears in merged_groups(root)]
        # (the dict that holds it, its name) of each weight and its scales where quantized (parameters;
        # buffers for Fp8Linear), read directly: Module.__getattr__ per tensor would cost more than the compare
        self._holders = [(lin._parameters if name in lin._parameters else lin._buffers, name)
                         for _, linears, _, _ in self.groups for lin in linears
                         for name in ("weight", scale_attr(lin)) if name]
        self._expect = self._addresses()
        self.restored: list[str] = []           # every weight restored, for the report

    def _addresses(self) -> list[int]:
        return [d[name].data_ptr() for d, name in self._holders]

    def check(self) -> None:
        """Copy any merged projection weight given new storage back into the merged weight."""
        if not self.groups or self._addresses() == self._expect:
            return
        for module, linears, rows, where in self.groups:
            self.restored += [f"{where}.{n}" for n in restore_views(module, linears, rows, where)
                              if f"{where}.{n}" not in self.restored]
        self._expect = self._addresses()


class TiedHeadWatch:
    """quantize_lm_head on a tied model: the fp8 lm_head is a quantized copy of the embedding
    table, where HF's tied head reads the table itself. An edit of the table since (in place: its
    version counter moves; or new storage) is quantized into the copy again, in place, before the
    next call, as above."""

    def __init__(self, model):
        head = getattr(model, "get_output_embeddings", lambda: None)()
        table = getattr(model, "get_input_embeddings", lambda: None)()
        tied = isinstance(head, Fp8Linear) and getattr(head, "tied_table", False) and table is not None
        self.head, self.holder = (head, table._parameters) if tied else (None, None)
        self._seen = self._state()
        self.requantized = 0

    def _state(self):
        if self.holder is None:
            return None
        t = self.holder["weight"]
        return t.data_ptr(), t._version

    def check(self) -> None:
        if self.holder is None or self._state() == self._seen:
            return
        with torch.no_grad():
            q, s = quantize_weight_reference(self.holder["weight"])
            self.head.weight.copy_(q)
            self.head.weight_scale.copy_(s)
        self.requantized += 1
        self._seen = self._state()
