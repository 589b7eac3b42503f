"""GeLU-tanh · mul → ``gemma4opt.gelu_tanh_mul``.

Unfused (dense MLP, MoE experts, the PLE gate)::

    a = gelu(gate, approximate="tanh")
    out = a * up

Fused::

    out = gemma4opt.gelu_tanh_mul(gate, up)

With merged_projections, gate and up are the two halves of one GEMM output and the kernel
reads them in place. A gelu whose output has other users stays unfused.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import innermost, op_name, place


class GeluTanhMulPattern(Pattern):
    name = "gelu_tanh_mul"
    summary = "gelu_tanh(gate) * up -> gemma4opt.gelu_tanh_mul (MLP, experts, PLE)"

    def expected(self, cfg, scope):
        L = cfg.num_hidden_layers
        # quantization="fp8": the experts' gelu is inside gemma4opt.moe_experts_fp8 (ops/fp8_weights.py).
        experts = bool(cfg.enable_moe_block) and self.quantization != "fp8"
        return L * (1 + bool(cfg.hidden_size_per_layer_input) + experts)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for gelu in list(gm.graph.nodes):
            if op_name(gelu) != "gelu" or gelu.kwargs.get("approximate") != "tanh":
                continue
            where = (innermost(gelu) or ("?",))[0]
            mul = next(iter(gelu.users), None)
            if len(gelu.users) != 1 or op_name(mul) != "mul" or len(mul.args) != 2:
                res.unfused.append(f"{where}: gelu output is not only multiplied")
                continue
            up = mul.args[1] if mul.args[0] is gelu else mul.args[0]
            if not isinstance(up, fx.Node):
                res.unfused.append(f"{where}: multiplied by a constant")
                continue
            with gm.graph.inserting_before(mul):
                fused = gm.graph.call_function(torch.ops.gemma4opt.gelu_tanh_mul.default, (gelu.args[0], up))
            fused.meta = dict(mul.meta)
            mul.replace_all_uses_with(fused)
            place([fused])
            gm.graph.erase_node(mul)
            gm.graph.erase_node(gelu)
            res.matched += 1
        return res
