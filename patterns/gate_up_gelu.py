"""Merged gate/up GEMM + gelu·mul of a dense MLP → ``gemma4opt.gate_up_gelu``.

Unfused (what merged_projections, gelu_tanh_mul and decode_linear leave in each Gemma4TextMLP)::

    y = gemma4opt.linear(x, W_gate_up)                      # [.., 2I]
    act = gemma4opt.gelu_tanh_mul(y[..., :I], y[..., I:])

Fused::

    act = gemma4opt.gate_up_gelu(x, W_gate_up)

At one decode row on CUDA the op runs the GEMV with gelu·mul in its epilogue when that timed
faster (one launch instead of two); otherwise, and off CUDA, the two ops above (ops/gate_up_gelu.py).
One match per dense MLP. With quantization="fp8" the MLP's GEMMs are gemma4opt.fp8_linear calls
(their gelu quantizes for the down GEMM) and are left to it.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import BLOCK_FP8_OP, BLOCK_FP8_WHY, PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import op_name, place, regions_of_type


def _half(node, lin: fx.Node, lo: int, hi: int) -> bool:
    """node is ``lin[..., lo:hi]``, read only by one node."""
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and node.args[0] is lin
            and len(node.users) == 1):
        return False
    idx = node.args[1]
    if not (isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and isinstance(idx[1], slice)):
        return False
    s = idx[1]
    return s.start in ((lo,) if lo else (0, None)) and s.stop == hi and s.step in (None, 1)


class GateUpGeluPattern(Pattern):
    name = "gate_up_gelu"
    summary = "merged gate/up GEMM + gelu·mul of a dense MLP -> gemma4opt.gate_up_gelu (one launch at a decode row)"

    def expected(self, cfg, scope):
        return 0 if self.quantization == "fp8" else cfg.num_hidden_layers

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for region in regions_of_type(graph, "Gemma4TextMLP", subtree=True):
            if region.by_op("fp8_linear.default"):
                continue
            if region.by_op(BLOCK_FP8_OP) and not region.by_op("linear.default"):
                res.not_applicable.append(BLOCK_FP8_WHY)
                continue
            gelus = region.by_op("gelu_tanh_mul.default")
            why = "no gemma4opt.gelu_tanh_mul of a merged gemma4opt.linear's halves" if len(gelus) != 1 else None
            if why is None:
                gelu = gelus[0]
                g, u = gelu.args[:2]
                lin = g.args[0] if isinstance(g, fx.Node) and g.target is operator.getitem else None
                # The halves' size from the weight (the merged GEMM node's own meta may still describe
                # the gate projection it was made from).
                wt = lin.args[1] if isinstance(lin, fx.Node) and len(lin.args) > 1 else None
                val = wt.meta.get("val", wt.meta.get("example_value")) if isinstance(wt, fx.Node) else None
                two_i = val.shape[0] if isinstance(val, torch.Tensor) and val.dim() == 2 else None
                if not (lin is not None and op_name(lin) == "linear.default" and two_i and len(lin.users) == 2
                        and _half(g, lin, 0, two_i // 2) and _half(u, lin, two_i // 2, two_i) and not gelu.kwargs):
                    why = "gelu_tanh_mul's inputs are not the two halves of one gemma4opt.linear, read only there"
            if why:
                res.unfused.append(f"{region.path}: {why}")
                continue
            with graph.inserting_before(gelu):
                new = graph.call_function(torch.ops.gemma4opt.gate_up_gelu.default, (lin.args[0], lin.args[1]))
            new.meta = dict(gelu.meta)
            gelu.replace_all_uses_with(new)
            place([new])
            for n in (gelu, g, u, lin):
                graph.erase_node(n)
            res.matched += 1
        return res
