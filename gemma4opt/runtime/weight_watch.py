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

from gemma4opt.patterns.merged_projections import merged_groups, restore_views


class MergedWeightWatch:
    def __init__(self, root):
        names = {m: n for n, m in root.named_modules()}
        # each linear's rows in its merged weight, as merged: a replaced weight may have other rows
        self.groups = [(module, linears, [lin.weight.shape[0] for lin in linears], names.get(module, "?"))
                       for module, linears in merged_groups(root)]
        # the dicts that hold each weight (parameters; buffers for fp8), read directly: Module.__getattr__
        # per weight would cost more than the compare
        self._holders = [lin._parameters if "weight" in lin._parameters else lin._buffers
                         for _, linears, _, _ in self.groups for lin in linears]
        self._expect = self._addresses()
        self.restored: list[str] = []           # every weight restored, for the report

    def _addresses(self) -> list[int]:
        return [d["weight"].data_ptr() for d in self._holders]

    def check(self) -> None:
        """Copy any merged projection weight given new storage back into the merged weight."""
        if not self.groups or self._addresses() == self._expect:
            return
        for module, linears, rows, where in self.groups:
            self.restored += [f"{where}.{n}" for n in restore_views(module, linears, rows, where)
                              if f"{where}.{n}" not in self.restored]
        self._expect = self._addresses()
