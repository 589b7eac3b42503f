"""Decoder-layer projections → ``gemma4opt.linear`` (a per-shape pick of GEMM at decode).

Unfused (every attention and dense MLP; after merged_projections, the merged GEMMs)::

    y = linear(x, W)                # cuBLAS at every row count

Fused::

    y = gemma4opt.linear(x, W)      # <= 32 rows on CUDA: the skinny Triton GEMM or cuBLAS,
                                    # whichever timed faster on that shape (ops/linear.py)

One match per attention block and per dense MLP whose every linear was replaced: 2 per layer,
with or without merged projections; with per-layer inputs (PLE: e2b, e4b) one more per layer for
its gate (hidden -> 256) and projection (256 -> hidden). On the H200 cuBLAS took 5-6 us for each
of those 1.3 MB GEMVs at one row, 4x their bytes' time (profile_e4b_h200.txt), so they get the
same per-shape pick. A linear with a bias stays as it is, and the block is listed as unfused.
The MoE experts and the router are not touched. With quantization="fp8" the attention and MLP
projections are gemma4opt.fp8_linear calls and are left to it; the PLE projections stay bf16
and are taken as without it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import BLOCK_FP8_OP, BLOCK_FP8_WHY, PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import module_name, place, regions_of_type

_BLOCKS = ("Gemma4TextAttention", "Gemma4TextMLP")
_PLE = ("per_layer_input_gate", "per_layer_projection")     # a decoder layer's own PLE linears


class DecodeLinearPattern(Pattern):
    name = "decode_linear"
    summary = "attention / MLP / PLE linears -> gemma4opt.linear (skinny Triton GEMM or cuBLAS per decode shape)"

    def expected(self, cfg, scope):
        # quantization="fp8": the blocks' projections are gemma4opt.fp8_linear already.
        L = cfg.num_hidden_layers
        return (0 if self.quantization == "fp8" else 2 * L) + (L if cfg.hidden_size_per_layer_input else 0)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for type_name in _BLOCKS:
            for region in regions_of_type(gm.graph, type_name, subtree=True):
                linears = region.by_op("linear")
                if not linears and region.by_op("fp8_linear.default"):
                    continue
                if not linears and region.by_op(BLOCK_FP8_OP):
                    res.not_applicable.append(BLOCK_FP8_WHY)
                    continue
                biased = [n for n in linears if _biased(n)]
                if not linears or biased:
                    res.unfused.append(f"{region.path}: " + ("a linear has a bias" if biased else "no linear found"))
                    continue
                _replace(gm.graph, linears)
                res.matched += 1
        for layer in regions_of_type(gm.graph, "Gemma4TextDecoderLayer", subtree=True):
            ple = [n for n in layer.by_op("linear") if module_name(n) in _PLE]
            if not ple and any(module_name(n) in _PLE for n in layer.by_op(BLOCK_FP8_OP)):
                res.not_applicable.append(BLOCK_FP8_WHY)
                continue
            if not ple:
                continue
            if len(ple) != 2 or any(_biased(n) for n in ple):
                res.unfused.append(f"{layer.path}: PLE " + ("a linear has a bias" if len(ple) == 2 else
                                                            f"{len(ple)} of its 2 linears found"))
                continue
            _replace(gm.graph, ple)
            res.matched += 1
        return res


def _biased(lin: fx.Node) -> bool:
    return (len(lin.args) > 2 and lin.args[2] is not None) or lin.kwargs.get("bias") is not None


def _replace(graph: fx.Graph, linears: list[fx.Node]) -> None:
    for lin in linears:
        with graph.inserting_before(lin):
            new = graph.call_function(torch.ops.gemma4opt.linear.default,
                                      (lin.args[0], lin.args[1] if len(lin.args) > 1 else lin.kwargs["weight"]))
        new.meta = dict(lin.meta)
        lin.replace_all_uses_with(new)
        place([new])
        graph.erase_node(lin)
