"""lm_head + final-logit softcap → ``gemma4opt.linear_softcap``.

Unfused (Gemma4ForCausalLM.forward; generate passes logits_to_keep, so only the positions it
reads reach lm_head)::

    logits = linear(h, W_lm)
    logits = tanh(logits / cap) * cap

Fused::

    logits = gemma4opt.linear_softcap(h, W_lm, cap)     # the cap applied in place on the GEMM output

With an fp8 lm_head (Gemma4OptConfig(quantize_lm_head=True)) the linear is
``gemma4opt.fp8_linear(q, s, W_q, w_s, dtype)``, and the softcap becomes its ``cap`` argument.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import innermost, op_name, place, scalar_operand


class LogitSoftcapPattern(Pattern):
    name = "logit_softcap"
    summary = "lm_head linear + tanh softcap -> gemma4opt.linear_softcap"

    def expected(self, cfg, scope):
        return int(scope == "causal_lm" and cfg.final_logit_softcapping is not None)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for tanh in list(gm.graph.nodes):
            if op_name(tanh) != "tanh" or len(tanh.users) != 1:
                continue
            div, mul = tanh.args[0], next(iter(tanh.users))
            if op_name(div) != "div" or op_name(mul) != "mul" or len(div.users) != 1:
                continue
            lin, cap = div.args[0], div.args[1]
            if not isinstance(cap, (int, float)) or scalar_operand(mul) != (tanh, cap):
                continue
            if op_name(lin) == "fp8_linear.default" and len(lin.users) == 1 and len(lin.args) == 5 \
                    and not lin.kwargs:
                # An fp8 lm_head (quantize_lm_head=True): the softcap becomes the fp8 GEMM's epilogue.
                with gm.graph.inserting_before(mul):
                    fused = gm.graph.call_function(torch.ops.gemma4opt.fp8_linear.default, (*lin.args, float(cap)))
                self._finish(gm, fused, (mul, tanh, div, lin))
                res.matched += 1
                continue
            if op_name(lin) != "linear" or len(lin.users) != 1 or (len(lin.args) > 2 and lin.args[2] is not None):
                res.unfused.append(f"{(innermost(tanh) or ('?',))[0]}: softcap input is not a bias-free linear")
                continue
            with gm.graph.inserting_before(mul):
                fused = gm.graph.call_function(torch.ops.gemma4opt.linear_softcap.default,
                                               (lin.args[0], lin.args[1], float(cap)))
            self._finish(gm, fused, (mul, tanh, div, lin))
            res.matched += 1
        return res

    @staticmethod
    def _finish(gm, fused, old):
        mul = old[0]
        fused.meta = dict(mul.meta)
        mul.replace_all_uses_with(fused)
        place([fused])
        for n in old:
            gm.graph.erase_node(n)
