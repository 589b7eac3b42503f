"""A gelu·mul and the GEMM it feeds → one op: ``gemma4opt.gelu_linear`` / ``gate_up_gelu_linear``.

Unfused (what gelu_tanh_mul, decode_linear and gate_up_gelu leave)::

    act = gemma4opt.gelu_tanh_mul(per_layer_input_gate(h), per_layer_input)    # PLE (e2b, e4b)
    y = gemma4opt.linear(act, W_per_layer_projection)

    act = gemma4opt.gate_up_gelu(x, W_gate_up)          # dense MLP (gemma4opt.gelu_tanh_mul of the
    y = gemma4opt.linear(act, W_down)                   # gate/up halves where gate_up_gelu is off)

Fused::

    y = gemma4opt.gelu_linear(per_layer_input_gate(h), per_layer_input, W_per_layer_projection)
    y = gemma4opt.gate_up_gelu_linear(x, W_gate_up, W_down)     # or gelu_linear(gate, up, W_down)

At decode rows on CUDA the GEMM makes the gelu·mul as it reads its input (one launch for two)
where that timed faster; the MLP's op first asks gate_up_gelu's own pick, whose fused GEMV puts
the gelu·mul in its epilogue instead (ops/gelu_linear.py). Off CUDA and at prefill, the ops above.
One match per dense MLP in bf16 (with quantization="fp8" its down is gemma4opt.fp8_linear, whose
input the gelu kernel quantizes) and one per PLE layer (its projections stay bf16 with fp8).
"""
from __future__ import annotations


import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import BLOCK_FP8_OP, BLOCK_FP8_WHY, PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import module_name, op_name, place, regions_of_type

# (region type, the GEMM's module name): the down projection of a dense MLP, a layer's PLE projection.
_SITES = (("Gemma4TextMLP", "down_proj"), ("Gemma4TextDecoderLayer", "per_layer_projection"))


class GeluLinearPattern(Pattern):
    name = "gelu_linear"
    summary = "gelu·mul + the GEMM it feeds (MLP down, PLE projection) -> one op (gelu·mul inside the GEMM at decode)"

    def expected(self, cfg, scope):
        L = cfg.num_hidden_layers
        return (0 if self.quantization == "fp8" else L) + (L if cfg.hidden_size_per_layer_input else 0)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for type_name, proj in _SITES:
            for region in regions_of_type(graph, type_name, subtree=True):
                if type_name == "Gemma4TextMLP" and region.by_op("fp8_linear.default"):
                    continue
                lins = [n for n in region.by_op("linear.default") if module_name(n) == proj]
                if not lins and any(module_name(n) == proj for n in region.by_op(BLOCK_FP8_OP)):
                    res.not_applicable.append(BLOCK_FP8_WHY)
                    continue
                if type_name == "Gemma4TextDecoderLayer" and not lins:
                    continue            # a layer without per-layer inputs
                why = _fuse(graph, lins)
                if why:
                    res.unfused.append(f"{region.path}: {why}")
                else:
                    res.matched += 1
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
