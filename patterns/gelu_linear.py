"""A gelu·mul and the GEMM it feeds → one op: ``gemma4opt.gelu_linear`` / ``gate_up_gelu_linear``.

Unfused (what gelu_tanh_mul, decode_linear and gate_up_gelu leave)::

    act = gemma4opt.gelu_tanh_mul(per_layer_input_gate(h), per_layer_input)    # PLE (e2b, e4b)
    y = gemma4opt.linear(act, W_per_layer_projection)

    act = gemma4opt.gate_up_gelu(x, W_gate_up)          # dense MLP (gemma4opt.gelu_tanh_mul of the
    y = gemma4opt.linear(act, W_down)                   # gate/up halves where gate_up_gelu is off)

    y = gemma4opt.fp8_linear(xq, xs, W_gate_up_fp8, s_gate_up, dtype)       # fp8 dense MLP (fp8_quant's)
    q, qs = gemma4opt.gelu_tanh_mul_quant(y[..., :I], y[..., I:])
    out = gemma4opt.fp8_linear(q, qs, W_down_fp8, s_down, dtype)

Fused::

    y = gemma4opt.gelu_linear(per_layer_input_gate(h), per_layer_input, W_per_layer_projection)
    y = gemma4opt.gate_up_gelu_linear(x, W_gate_up, W_down)     # or gelu_linear(gate, up, W_down)
    out = gemma4opt.fp8_gate_up_gelu_linear(xq, xs, W_gate_up_fp8, s_gate_up, W_down_fp8, s_down, dtype)

At decode rows on CUDA the GEMM makes the gelu·mul as it reads its input (one launch for two)
where that timed faster; the MLP's op first asks gate_up_gelu's own pick, whose fused GEMV puts
the gelu·mul in its epilogue instead (ops/gelu_linear.py). Off CUDA and at prefill, the ops above.
With fp8 weights at one decode row the MLP's op runs the gate/up GEMV with gelu·mul in its epilogue
and a down GEMM that quantizes that activation as it reads it, each where its pick timed it faster
(ops/gelu_linear.py). One match per dense MLP and one per PLE layer (its projections stay bf16 with fp8).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import BLOCK_FP8_OP, BLOCK_FP8_WHY, PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import module_name, op_name, place, regions_of_type
from .gate_up_gelu import _half

# (region type, the GEMM's module name): the down projection of a dense MLP, a layer's PLE projection.
_SITES = (("Gemma4TextMLP", "down_proj"), ("Gemma4TextDecoderLayer", "per_layer_projection"))


class GeluLinearPattern(Pattern):
    name = "gelu_linear"
    summary = "gelu·mul + the GEMM it feeds (MLP down, PLE projection) -> one op (gelu·mul inside the GEMM at decode)"

    def expected(self, cfg, scope):
        L = cfg.num_hidden_layers
        return L + (L if cfg.hidden_size_per_layer_input else 0)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for type_name, proj in _SITES:
            for region in regions_of_type(graph, type_name, subtree=True):
                if type_name == "Gemma4TextMLP" and region.by_op("fp8_linear.default"):
                    res.site(region.path, _fuse_fp8(graph, region))
                    continue
                lins = [n for n in region.by_op("linear.default") if module_name(n) == proj]
                if not lins and any(module_name(n) == proj for n in region.by_op(BLOCK_FP8_OP)):
                    res.not_applicable.append(BLOCK_FP8_WHY)
                    continue
                if type_name == "Gemma4TextDecoderLayer" and not lins:
                    continue            # a layer without per-layer inputs
                res.site(region.path, _fuse(graph, lins))
        return res


def _fuse(graph: fx.Graph, lins: list[fx.Node]) -> str | None:
    """Replace the one gemma4opt.linear in ``lins`` and the gelu·mul op feeding it; else why not."""
    if len(lins) != 1 or lins[0].kwargs:
        return f"{len(lins)} gemma4opt.linear of that projection (one expected)"
    lin = lins[0]
    act = lin.args[0]
    kind = op_name(act) if isinstance(act, fx.Node) else None
    if kind not in ("gelu_tanh_mul.default", "gate_up_gelu.default") or len(act.users) != 1 or act.kwargs:
        return "its input is not a gemma4opt.gelu_tanh_mul or gate_up_gelu read only there"
    target = (torch.ops.gemma4opt.gelu_linear.default if kind == "gelu_tanh_mul.default"
              else torch.ops.gemma4opt.gate_up_gelu_linear.default)
    with graph.inserting_before(lin):
        new = graph.call_function(target, (*act.args[:2], lin.args[1]))
    new.meta = dict(lin.meta)
    lin.replace_all_uses_with(new)
    place([new])
    graph.erase_node(lin)
    graph.erase_node(act)
    return None


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _fuse_fp8(graph: fx.Graph, region) -> str | None:
    """Replace an fp8 dense MLP's gate/up GEMM, gelu·mul + quantization and down GEMM (read only by one
    another) with gemma4opt.fp8_gate_up_gelu_linear; else why not."""
    downs = [n for n in region.by_op("fp8_linear.default") if module_name(n) == "down_proj"]
    if len(downs) != 1 or downs[0].kwargs or downs[0].args[5:6] not in ((), (0.0,), (0,)):
        return f"{len(downs)} gemma4opt.fp8_linear of down_proj without a softcap (one expected)"
    down = downs[0]
    q, s = down.args[:2]
    quant = q.args[0] if isinstance(q, fx.Node) and q.target is operator.getitem else None
    if not (quant is not None and op_name(quant) == "gelu_tanh_mul_quant.default" and not quant.kwargs
            and isinstance(s, fx.Node) and s.target is operator.getitem and s.args[0] is quant
            and (q.args[1], s.args[1]) == (0, 1) and len(quant.users) == 2
            and _only_user(q) is down and _only_user(s) is down):
        return "down_proj's input is not a gemma4opt.gelu_tanh_mul_quant read only there"
    g, u = quant.args[:2]
    gate_up = g.args[0] if isinstance(g, fx.Node) and g.target is operator.getitem else None
    wt = gate_up.args[2] if isinstance(gate_up, fx.Node) and len(gate_up.args) > 2 else None
    val = wt.meta.get("val", wt.meta.get("example_value")) if isinstance(wt, fx.Node) else None
    two_i = val.shape[0] if isinstance(val, torch.Tensor) and val.dim() == 2 else None
    if not (gate_up is not None and op_name(gate_up) == "fp8_linear.default" and two_i and not gate_up.kwargs
            and gate_up.args[5:6] in ((), (0.0,), (0,)) and len(gate_up.users) == 2
            and _half(g, gate_up, 0, two_i // 2) and _half(u, gate_up, two_i // 2, two_i)):
        return "gelu_tanh_mul_quant's inputs are not the two halves of one gemma4opt.fp8_linear, read only there"
    xq, xs, w_gu, s_gu, dtype = gate_up.args[:5]
    with graph.inserting_before(down):
        new = graph.call_function(torch.ops.gemma4opt.fp8_gate_up_gelu_linear.default,
                                  (xq, xs, w_gu, s_gu, down.args[2], down.args[3], dtype))
    new.meta = dict(down.meta)
    down.replace_all_uses_with(new)
    place([new])
    for n in (down, q, s, quant, g, u, gate_up):
        graph.erase_node(n)
    return None
