"""A GEMM input's own fp8 quantization → inside the fp8 GEMM that reads it (quantization="fp8").

Unfused (what fp8_quant leaves: an input no gemma4opt kernel produces, the attention output)::

    q, s = gemma4opt.quantize_rows(attn)
    y = gemma4opt.fp8_linear(q, s, W_o_fp8, w_scale, dtype)

Fused::

    y = gemma4opt.quant_fp8_linear(attn, W_o_fp8, w_scale, dtype)

At decode rows on CUDA the GEMM quantizes its input as it reads it (one launch for two) where that
timed faster; else, and off CUDA, the two ops (ops/quant_fp8_linear.py). One match per layer (its
o_proj); any other quantize_rows read by one fp8 GEMM alone (without a softcap) is taken too.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import innermost, op_name, place


class QuantLinearPattern(Pattern):
    name = "quant_linear"
    summary = "per-token fp8 quantization + the fp8 GEMM reading it (o_proj) -> one op (quantized inside the GEMM at decode)"
    quantized_only = True

    def expected(self, cfg, scope):
        return cfg.num_hidden_layers if self.quantization == "fp8" else 0

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for quant in list(graph.nodes):
            if op_name(quant) != "quantize_rows.default":
                continue
            res.site((innermost(quant) or ("?",))[0], _fuse(graph, quant))
        return res


def _fuse(graph: fx.Graph, quant: fx.Node) -> str | None:
    """quantize_rows and the one fp8 GEMM reading both its outputs -> quant_fp8_linear; else why not."""
    items = {u.args[1]: u for u in quant.users if u.target is operator.getitem}
    q, s = items.get(0), items.get(1)
    if quant.kwargs or len(quant.users) != 2 or q is None or s is None:
        return "its outputs are not read as (bytes, scales)"
    gemms = set(q.users) | set(s.users)
    gemm = gemms.pop() if len(gemms) == 1 else None
    if not (gemm is not None and op_name(gemm) == "fp8_linear.default" and len(q.users) == len(s.users) == 1
            and list(gemm.args[:2]) == [q, s] and not gemm.kwargs and gemm.args[5:6] in ((), (0.0,), (0,))):
        return "its bytes and scales are not read by one gemma4opt.fp8_linear alone (without a softcap)"
    with graph.inserting_before(gemm):
        new = graph.call_function(torch.ops.gemma4opt.quant_fp8_linear.default, (quant.args[0], *gemm.args[2:5]))
    new.meta = dict(gemm.meta)
    gemm.replace_all_uses_with(new)
    place([new])
    for n in (gemm, q, s, quant):
        graph.erase_node(n)
    return None
