"""A decoder layer's per-layer-input (PLE) gelu·mul and its projection → ``gemma4opt.gelu_linear``.

Unfused (what gelu_tanh_mul and decode_linear leave in each layer of the PLE models, e2b and e4b)::

    act = gemma4opt.gelu_tanh_mul(per_layer_input_gate(h), per_layer_input)
    y = gemma4opt.linear(act, W_per_layer_projection)

Fused::

    y = gemma4opt.gelu_linear(per_layer_input_gate(h), per_layer_input, W_per_layer_projection)

At decode rows on CUDA the op runs the skinny GEMM with the gelu·mul made as it reads its input
(one launch instead of two) where that timed faster; otherwise, and off CUDA, the two ops above
(ops/gelu_linear.py). One match per layer with per-layer inputs, with or without fp8 weights (the
PLE projections stay bf16). The dense MLP's gelu·mul is gate_up_gelu's (it fuses it with the
GEMM before it), so it is not taken here.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import module_stack, op_name, place, regions_of_type


class GeluLinearPattern(Pattern):
    name = "gelu_linear"
    summary = "PLE gelu·mul + projection -> gemma4opt.gelu_linear (gelu·mul made inside the GEMM at decode)"

    def expected(self, cfg, scope):
        return cfg.num_hidden_layers if cfg.hidden_size_per_layer_input else 0

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for layer in regions_of_type(graph, "Gemma4TextDecoderLayer", subtree=True):
            projs = [n for n in layer.by_op("linear.default")
                     if module_stack(n)[-1][0].rsplit(".", 1)[-1] == "per_layer_projection"]
            if not projs:
                continue
            lin = projs[0]
            act = lin.args[0]
            if not (len(projs) == 1 and isinstance(act, fx.Node) and op_name(act) == "gelu_tanh_mul.default"
                    and len(act.users) == 1 and not act.kwargs and not lin.kwargs):
                res.unfused.append(f"{layer.path}: the PLE projection's input is not a gemma4opt.gelu_tanh_mul "
                                   "read only there")
                continue
            with graph.inserting_before(lin):
                new = graph.call_function(torch.ops.gemma4opt.gelu_linear.default, (*act.args[:2], lin.args[1]))
            new.meta = dict(lin.meta)
            lin.replace_all_uses_with(new)
            place([new])
            graph.erase_node(lin)
            graph.erase_node(act)
            res.matched += 1
        return res
