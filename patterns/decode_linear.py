"""Decoder-layer projections → ``gemma4opt.linear`` (a per-shape pick of GEMM at decode).

Unfused (every attention and dense MLP; after merged_projections, the merged GEMMs)::

    y = linear(x, W)                # cuBLAS at every row count

Fused::

    y = gemma4opt.linear(x, W)      # <= 32 rows on CUDA: the skinny Triton GEMM or cuBLAS,
                                    # whichever timed faster on that shape (ops/linear.py)

One match per attention block and per dense MLP whose every linear was replaced: 2 per layer,
with or without merged projections. A linear with a bias stays as it is, and the block is
listed as unfused. The MoE experts, the router and the PLE projections are not touched. With
quantization="fp8" the blocks' projections are gemma4opt.fp8_linear calls and are left to it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import place, regions_of_type

_BLOCKS = ("Gemma4TextAttention", "Gemma4TextMLP")


class DecodeLinearPattern(Pattern):
    name = "decode_linear"
    summary = "attention / MLP linears -> gemma4opt.linear (skinny Triton GEMM or cuBLAS per decode shape)"

    def expected(self, cfg, scope):
        # quantization="fp8": these blocks' projections are gemma4opt.fp8_linear already.
        return 0 if self.quantization == "fp8" else 2 * cfg.num_hidden_layers

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for type_name in _BLOCKS:
            for region in regions_of_type(gm.graph, type_name, subtree=True):
                linears = region.by_op("linear")
                if not linears and region.by_op("fp8_linear.default"):
                    continue
                biased = [n for n in linears if (len(n.args) > 2 and n.args[2] is not None) or n.kwargs.get("bias") is not None]
                if not linears or biased:
                    res.unfused.append(f"{region.path}: " + ("a linear has a bias" if biased else "no linear found"))
                    continue
                for lin in linears:
                    with gm.graph.inserting_before(lin):
                        new = gm.graph.call_function(torch.ops.gemma4opt.linear.default,
                                                     (lin.args[0], lin.args[1] if len(lin.args) > 1
                                                      else lin.kwargs["weight"]))
                    new.meta = dict(lin.meta)
                    lin.replace_all_uses_with(new)
                    place([new])
                    gm.graph.erase_node(lin)
                res.matched += 1
        return res
