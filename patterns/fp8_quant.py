"""A GEMM input's fp8 quantization → inside the kernel that produces it (quantization="fp8").

Unfused (each Fp8Linear quantizes its input per token; after merged_projections, once per merged
GEMM)::

    n = gemma4opt.rms_norm(x, w, eps)                 # or the residual tail's normed output,
    q, s = gemma4opt.quantize_rows(n)                 #   or gemma4opt.gelu_tanh_mul(gate, up)
    y = gemma4opt.fp8_linear(q, s, Wq, Ws)

Fused (one launch writes the fp8 bytes and the scales; the bf16 n is never written)::

    q, s = gemma4opt.rms_norm_quant(x, w, eps)
    r, q, s = gemma4opt.add_rms_norm_quant(x, res, w1, eps1, scale, w2, eps2)
    q, s = gemma4opt.gelu_tanh_mul_quant(gate, up)

Per decoder layer: the norm before q/k/v (the first layer's rms_norm, then the residual tails), the
norm before the dense MLP's gate/up, and the gelu before down_proj — 3 per layer. A producer whose
output something else reads too stays as it is (listed). The attention output before o_proj has no
gemma4opt producer and keeps its own quantize_rows.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import innermost, op_name, place

_FUSED = {"rms_norm.default": torch.ops.gemma4opt.rms_norm_quant.default,
          "gelu_tanh_mul.default": torch.ops.gemma4opt.gelu_tanh_mul_quant.default,
          "add_rms_norm.default": torch.ops.gemma4opt.add_rms_norm_quant.default}


class Fp8QuantPattern(Pattern):
    name = "fp8_quant"
    summary = "rms_norm / residual tail / gelu_tanh_mul + per-token fp8 quantization -> one kernel each"
    quantized_only = True

    def expected(self, cfg, scope):
        if self.quantization != "fp8":
            return 0
        # An fp8 lm_head's input is the final norm's output, quantized by it (in the CausalLM's graph).
        return 3 * cfg.num_hidden_layers + int(self.quantize_lm_head and scope == "causal_lm")

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for node in list(gm.graph.nodes):
            name = op_name(node)
            if name not in _FUSED:
                continue
            # The value quantized: the op's output, or the residual tail's normed output (item 1).
            value = node if name != "add_rms_norm.default" else _item(node, 1)
            if value is None:
                continue
            rows = None                 # the first KV-shared layer's prefill norms every row, then slices
            if len(value.users) == 1 and op_name(next(iter(value.users))) == "getitem" and name != "gelu_tanh_mul.default":
                value = next(iter(value.users))
                rows = value.args[1]
            quants = [u for u in value.users if op_name(u) == "quantize_rows.default"]
            if not quants:
                continue
            where = (innermost(node) or ("?",))[0]
            if len(quants) != len(value.users):
                res.unfused.append(f"{where}: {name.split('.')[0]}'s output is also read unquantized")
                continue
            if rows is not None and _scale_rows(rows) is None:
                res.unfused.append(f"{where}: its output is indexed by {rows!r}, not by rows only")
                continue
            _fuse(gm.graph, node, name, quants, rows)
            res.matched += 1
        return res


def _item(node: fx.Node, index: int) -> fx.Node | None:
    found = [u for u in node.users if op_name(u) == "getitem" and u.args[1] == index]
    return found[0] if len(found) == 1 and len(node.users) <= 2 else None


def _scale_rows(index):
    """The index of the scales [..., rows] that picks what ``index`` picks of x [..., rows, D]: the same
    index without its last entry, when that entry takes all of D."""
    if isinstance(index, tuple) and index and index[-1] == slice(None):
        return index[:-1]
    return None


def _fuse(graph: fx.Graph, node: fx.Node, name: str, quants: list[fx.Node], rows=None) -> None:
    """Replace node (and its quantize_rows users) by the fused op; items shift by one after the
    residual tail's sum. ``rows``: the index the quantized value was taken through (the fused
    outputs are indexed alike: x's by it, the scales' by _scale_rows of it)."""
    offset = 1 if name == "add_rms_norm.default" else 0
    with graph.inserting_before(node):
        fused = graph.call_function(_FUSED[name], node.args, dict(node.kwargs))
    fused.meta = dict(node.meta)
    new = [fused]
    if offset:                                   # the sum keeps its item 0
        total = _item(node, 0)
        if total is not None:
            with graph.inserting_after(fused):
                s = graph.call_function(operator.getitem, (fused, 0))
            s.meta = dict(total.meta)
            total.replace_all_uses_with(s)
            graph.erase_node(total)
            new.append(s)
    sliced = quants[0].args[0] if rows is not None else None
    for quant in quants:
        for item in list(quant.users):
            i = item.args[1]
            with graph.inserting_after(fused):
                g = graph.call_function(operator.getitem, (fused, i + offset))
            g.meta = dict(item.meta)
            new.append(g)
            if rows is not None:
                with graph.inserting_after(g):
                    g = graph.call_function(operator.getitem, (g, rows if i == 0 else _scale_rows(rows)))
                g.meta = dict(item.meta)
                new.append(g)
            item.replace_all_uses_with(g)
            graph.erase_node(item)
        graph.erase_node(quant)
    if sliced is not None:
        graph.erase_node(sliced)
    if offset:
        graph.erase_node(_item(node, 1))
    graph.erase_node(node)
    place(new)
